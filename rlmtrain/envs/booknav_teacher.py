"""A scripted BookNavigator teacher: the code an expert would type, one block per turn.

Like every teacher it plays through the real scheduler (`rollout/teaching.py`), answering turn t
with the t-th block of its plan. The plan never reads the REPL's output itself; what depends on the
output is in the code (REPL variables persist between turns), which is also the habit the
student should learn.

The expert reads the problem, not the hidden reference: a rule per problem family names the
notion to look up in the index and writes the proof from the numbers in the statement, citing
the result it read. Turns: table of contents and index look-up; read the first hit; FINAL(proof).
A problem no rule recognises raises ValueError naming it (a teacher that guesses would poison
the SFT data).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rlmtrain.config import RolloutConfig
from rlmtrain.envs.teacher import plan_reply

__all__ = ["plan", "prove", "teacher"]

WHO = "booknav teacher"


def _difference_of_powers(m: re.Match[str]) -> str:
    d, a = int(m["d"]), int(m["a"])
    if d != a - 1:
        raise ValueError(f"booknav teacher: {d} is not {a} - 1 in {m.string!r}")
    return (
        f"By the difference-of-powers factorisation (Theorem 2.1) with b = 1, "
        f"{a}^n - 1 = ({a} - 1)({a}^(n-1) + ... + {a} + 1) = {d} · ({a}^(n-1) + ... + 1). "
        f"The second factor is an integer, so {d} divides {a}^n - 1 for every n >= 1."
    )


def _consecutive_product(m: re.Match[str]) -> str:
    c, c1 = int(m["c"]), int(m["c1"])
    if c1 != c + 1:
        raise ValueError(f"booknav teacher: factors are not consecutive in {m.string!r}")
    return (
        f"The numbers n + {c} and n + {c1} are two consecutive integers, so by Lemma 2.3 "
        f"exactly one of them is divisible by 2. Hence their product (n + {c})(n + {c1}) is even."
    )


def _linear_combination(m: re.Match[str]) -> str:
    d, p, q = m["d"], m["p"], m["q"]
    return (
        f"Since {d} divides a and b, write a = {d}s and b = {d}t with integers s and t "
        f"(Lemma 1.2). Then {p}a + {q}b = {d}({p}s + {q}t), and {p}s + {q}t is an integer, "
        f"so {d} divides {p}a + {q}b."
    )


def _coprime_neighbours(m: re.Match[str]) -> str:
    c, c1 = int(m["c"]), int(m["c1"])
    if c1 != c + 1:
        raise ValueError(f"booknav teacher: arguments are not consecutive in {m.string!r}")
    return (
        f"Let d be a common divisor of n + {c} and n + {c1}. By Lemma 1.2 d divides their "
        f"difference (n + {c1}) - (n + {c}) = 1, so d = ±1. Hence gcd(n + {c}, n + {c1}) = 1, "
        f"as in Lemma 3.2 on consecutive integers."
    )


def _congruent_powers(m: re.Match[str]) -> str:
    x, r, mod = int(m["x"]), int(m["r"]), int(m["m"])
    if (x - r) % mod:
        raise ValueError(f"booknav teacher: {x} is not congruent to {r} mod {mod}")
    return (
        f"Since {x} - {r} = {x - r} = {mod} · {(x - r) // mod}, we have {x} ≡ {r} (mod {mod}). "
        f"By Lemma 1.3 on powers of congruent numbers, {x}^k ≡ {r}^k (mod {mod}) for every k >= 1."
    )


_RULES: list[tuple[re.Pattern[str], str, Callable[[re.Match[str]], str]]] = [
    (
        re.compile(r"(?P<d>\d+) divides (?P<a>\d+)\^n - 1"),
        "difference of powers",
        _difference_of_powers,
    ),
    (
        re.compile(r"\(n \+ (?P<c>\d+)\)\(n \+ (?P<c1>\d+)\) is even"),
        "consecutive integers",
        _consecutive_product,
    ),
    (
        re.compile(r"(?P<d>\d+) divides (?P<p>\d+)a \+ (?P<q>\d+)b"),
        "linear combinations",
        _linear_combination,
    ),
    (
        re.compile(r"gcd\(n \+ (?P<c>\d+), n \+ (?P<c1>\d+)\) = 1"),
        "coprime",
        _coprime_neighbours,
    ),
    (
        re.compile(r"(?P<x>\d+)\^k ≡ (?P<r>\d+)\^k \(mod (?P<m>\d+)\)"),
        "congruent",
        _congruent_powers,
    ),
]


def prove(problem: str) -> tuple[str, str]:
    """(index keyword, proof) for a problem of a known family."""
    for pattern, keyword, write_proof in _RULES:
        match = pattern.search(problem)
        if match:
            return keyword, write_proof(match)
    raise ValueError(f"booknav teacher: no rule for problem {problem!r}")


def plan(problem: str) -> list[str]:
    """The expert's code, one string per turn."""
    keyword, proof = prove(problem)
    return [
        f"toc = get_toc()\nhits = search_index({keyword!r})",
        "section = read_section(hits[0])\nprint(section)",
        f"proof = {proof!r}\nFINAL(proof)",
    ]


def teacher(config: RolloutConfig) -> Callable[[str], str]:
    """The teacher's reply: its plan for the prompt's query, a turn's block at a time."""
    return plan_reply(plan, WHO)
