"""BookNavigator (docs/algorithm.md §2): prove a statement by studying a textbook through tools.

The REPL's `context` is the book (ordered sections of id, title and text); the model looks things
up with `get_toc`, `search_index` and `read_section` (`booknav_tools`) and ends with its proof.
Each task is a proof problem with a hidden reference solution; the reward is a judge's pass/fail
verdict, r ∈ {-1, 1} (`rewards.judge.ProofJudge`), None when the judge cannot answer (the trainer
drops it). The exploration bonus needs the training step, so the reward leaves it to the trainer
and reports each root's b(τ) (`tool_diversity`, over the whole tree) in the details.

A task names its book by a JSON file path, relative paths being relative to the task file (one
book serves many problems and the data folder can move). Books are read once per env.

`synthetic_book()` / `synthetic_problems()` make a small deterministic number-theory textbook and
problems that each become a short proof once the right section is read: the data of tests,
teachers and the CPU smoke runs.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from rlmtrain.config import Config, ConfigError, RolloutConfig
from rlmtrain.envs.base import (
    Env,
    RewardResult,
    Task,
    read_tasks_beside,
    register_env,
    root_answers,
    write_tasks,
)
from rlmtrain.rewards.chat_client import ChatClient, JudgeConfig
from rlmtrain.rewards.exploration import diversity_bonus, tree_turns
from rlmtrain.rewards.judge import ProofJudge
from rlmtrain.rlm.records import RolloutGroup

__all__ = [
    "Book",
    "BookNavEnv",
    "BookTask",
    "Section",
    "read_book",
    "synthetic_book",
    "synthetic_problems",
    "write_synthetic",
]


class Section(msgspec.Struct, kw_only=True):
    id: str
    title: str
    text: str


class Book(msgspec.Struct, kw_only=True):
    title: str
    sections: list[Section]


class BookTask(Task):
    """`query` is the problem statement."""

    book: str
    """Path of the book's JSON file; relative = relative to the task file."""
    reference_solution: str
    """Hidden from the model; shown to the judge."""
    section_ids: list[str] = []
    """The sections whose results the proof uses (for teachers and analysis)."""
    index_keyword: str = ""
    """A keyword under which the index lists those sections (for teachers and analysis)."""


def read_book(path: str | Path) -> Book:
    """Read a book JSON file; a missing file or bad content raises an error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"book file not found: {path}")
    try:
        book = msgspec.json.decode(path.read_bytes(), type=Book)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not a valid book: {exc}") from None
    ids = [s.id for s in book.sections]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate section ids")
    return book


STRATEGY = """\
You prove a statement with the help of a textbook. The book is in `context` (do not print it
whole): use get_toc() to see its sections, search_index(keyword) to find where a notion or result
is treated, and read_section(section_id) to read one (print what you need). Find the result that
the problem is an instance of, read it, then write a complete proof that applies it: state what
you use, check its conditions for this problem, and conclude. Usually 2-4 turns. End with
FINAL(proof), the proof as one string."""


class BookNavEnv(Env):
    name = "booknav"
    pass_metric = "proof_pass_rate"
    task_type = BookTask

    def __init__(self, judge: JudgeConfig, client: ChatClient | None = None):
        self.judge = ProofJudge(judge, client)
        self._books: dict[str, dict[str, Any]] = {}

    def system_prompt(self) -> str:
        return STRATEGY

    def context(self, task: BookTask) -> dict[str, Any]:
        key = str(Path(task.book).resolve())
        if key not in self._books:
            self._books[key] = msgspec.to_builtins(read_book(key))
        return self._books[key]

    def tool_modules(self) -> list[str]:
        return ["rlmtrain.envs.booknav_tools"]

    def teacher(self, rollout: RolloutConfig) -> Callable[[str], str]:
        """The scripted teacher's reply (`booknav_teacher`), for `rollout.teaching.teach`."""
        from rlmtrain.envs.booknav_teacher import teacher

        return teacher(rollout)

    def load_tasks(self, path: str | Path) -> list[BookTask]:
        tasks = read_tasks_beside(path, BookTask, "book", folder=False)
        for task in tasks:  # read (and kept) now: a book that cannot be is named up front
            self.context(task)
        return tasks

    def synthesize(self, out_dir: Path, *, groups: int, first_group: int, config: Config) -> Path:
        """The synthetic textbook and one problem per group (`synthetic_problems`)."""
        return write_synthetic(out_dir, groups, config.data.seed, first=first_group)

    def vocabulary_texts(self, tasks: list[BookTask]) -> list[str]:
        """The base texts, the book of every task and the teacher's code for every task."""
        from rlmtrain.envs.booknav_teacher import plan

        texts = super().vocabulary_texts(tasks)
        books = {str(Path(task.book).resolve()): task for task in tasks}
        for task in books.values():
            texts += [section["text"] for section in self.context(task)["sections"]]
        for task in tasks:
            try:
                texts += plan(task.query)
            except ValueError:
                continue  # a problem of the user's own the teacher has no plan for: no code
        return texts

    async def reward(self, task: BookTask, group: RolloutGroup) -> RewardResult:
        verdicts = await asyncio.gather(
            *(
                self.judge.verdict(task.query, task.reference_solution, answer)
                for answer in root_answers(group)
            )
        )
        details = [
            {
                "method": verdict.method,
                "reason": verdict.reason,
                "tool_diversity": diversity_bonus(tree_turns(group, root)),
            }
            for root, verdict in zip(group.roots, verdicts, strict=True)
        ]
        return RewardResult(scores=[v.score for v in verdicts], details=details)


@register_env("booknav")
def make_booknav(config: Config | None) -> BookNavEnv:
    """BookNavigator's reward is a judge's verdict, so a run must name one in [judge]."""
    if config is None or not config.judge.base_url:
        raise ConfigError("judge.base_url: env 'booknav' is scored by a judge; set its endpoint")
    if config.data.teacher_flawed_share:
        raise ConfigError(
            "data.teacher_flawed_share: the booknav teacher has no flawed plan; set it to 0"
        )
    return BookNavEnv(config.judge)


# ---------------------------------------------------------------------------------------------
# A small synthetic textbook
# ---------------------------------------------------------------------------------------------

_SECTIONS = [
    (
        "1.1",
        "Parity",
        "An integer n is even if n = 2k for some integer k, and odd if n = 2k + 1 for some "
        "integer k. Every integer is either even or odd, and not both.\n"
        "Lemma 1.1 (sum of odd integers). The sum of two odd integers is even. Proof: write the "
        "integers as 2a + 1 and 2b + 1; their sum is 2a + 2b + 2 = 2(a + b + 1), which is even.",
    ),
    (
        "1.2",
        "Divisibility",
        "We say that d divides n, written d | n, if n = d k for some integer k.\n"
        "Lemma 1.2 (linear combinations). If d | a and d | b, then d | (m a + n b) for all "
        "integers m and n. Proof: write a = d s and b = d t; then m a + n b = d (m s + n t).",
    ),
    (
        "1.3",
        "Congruences",
        "For a modulus m >= 1 we write a ≡ b (mod m) when m | (a - b).\n"
        "Lemma 1.3 (powers of congruent numbers). If a ≡ b (mod m), then a^k ≡ b^k (mod m) for "
        "every integer k >= 1. Proof: a^k - b^k = (a - b)(a^(k-1) + a^(k-2) b + ... + b^(k-1)) "
        "by the factorisation of Section 2.1, and m divides the first factor.",
    ),
    (
        "2.1",
        "Factorisation of differences of powers",
        "Theorem 2.1 (difference of powers). For integers a, b and n >= 1, "
        "a^n - b^n = (a - b)(a^(n-1) + a^(n-2) b + ... + a b^(n-2) + b^(n-1)). Expanding the "
        "right-hand side, all terms cancel in pairs except a^n and -b^n.\n"
        "Corollary 2.1. (a - b) divides a^n - b^n for every n >= 1; for b = 1, (a - 1) divides "
        "a^n - 1. For n = 0 both sides are 0 and the divisibility holds trivially.",
    ),
    (
        "2.2",
        "Induction",
        "Principle of induction: if a statement P(n) holds for n = n0 and P(n) implies P(n + 1) "
        "for every n >= n0, then P(n) holds for every n >= n0.\n"
        "Example 2.2. 1 + 3 + ... + (2n - 1) = n^2: true for n = 1, and adding 2n + 1 to n^2 "
        "gives (n + 1)^2.",
    ),
    (
        "2.3",
        "Products of consecutive integers",
        "Lemma 2.3 (consecutive integers). Among any k consecutive integers exactly one is "
        "divisible by k. Proof: their remainders modulo k are k consecutive residues, so they "
        "run through 0, 1, ..., k - 1 once each.\n"
        "Corollary 2.3. The product of two consecutive integers is even, and the product of "
        "three consecutive integers is divisible by 6.",
    ),
    (
        "3.1",
        "Infinitude of primes",
        "Theorem 3.1 (Euclid). There are infinitely many primes. Proof: given primes p1, ..., pr, "
        "the number p1 p2 ... pr + 1 leaves remainder 1 on division by each pi, so any prime "
        "factor of it is a new prime.",
    ),
    (
        "3.2",
        "Greatest common divisors",
        "The greatest common divisor gcd(a, b) is the largest integer dividing both a and b.\n"
        "Lemma 3.2 (consecutive integers are coprime). gcd(n, n + 1) = 1 for every integer n. "
        "Proof: a common divisor d of n and n + 1 divides (n + 1) - n = 1 by Lemma 1.2, so d = 1.",
    ),
]


def synthetic_book() -> Book:
    return Book(
        title="A Short Course in Elementary Number Theory",
        sections=[Section(id=i, title=t, text=x) for i, t, x in _SECTIONS],
    )


def _difference_of_powers(a: int) -> tuple[str, str, list[str], str]:
    return (
        f"Prove that {a - 1} divides {a}^n - 1 for every integer n >= 1.",
        f"By the difference-of-powers factorisation (Theorem 2.1) with b = 1, "
        f"{a}^n - 1 = ({a} - 1)({a}^(n-1) + ... + {a} + 1) = {a - 1} · ({a}^(n-1) + ... + 1), "
        f"and the second factor is an integer, so {a - 1} divides {a}^n - 1.",
        ["2.1"],
        "difference of powers",
    )


def _consecutive_product(c: int) -> tuple[str, str, list[str], str]:
    return (
        f"Prove that (n + {c})(n + {c + 1}) is even for every integer n.",
        f"The numbers n + {c} and n + {c + 1} are two consecutive integers, so by Lemma 2.3 "
        f"one of them is divisible by 2; hence their product is even.",
        ["2.3"],
        "consecutive integers",
    )


def _linear_combination(d: int, m: int, n: int) -> tuple[str, str, list[str], str]:
    return (
        f"Prove that if {d} divides a and {d} divides b, then {d} divides {m}a + {n}b.",
        f"Write a = {d}s and b = {d}t with integers s, t (Lemma 1.2). Then "
        f"{m}a + {n}b = {d}({m}s + {n}t), so {d} divides {m}a + {n}b.",
        ["1.2"],
        "linear combinations",
    )


def _coprime_neighbours(c: int) -> tuple[str, str, list[str], str]:
    return (
        f"Prove that gcd(n + {c}, n + {c + 1}) = 1 for every integer n.",
        f"A common divisor d of n + {c} and n + {c + 1} divides their difference "
        f"(n + {c + 1}) - (n + {c}) = 1 by Lemma 1.2, so d = ±1 and the gcd is 1 (Lemma 3.2).",
        ["3.2", "1.2"],
        "coprime",
    )


def _congruent_powers(m: int, r: int, x: int) -> tuple[str, str, list[str], str]:
    return (
        f"Prove that {x}^k ≡ {r}^k (mod {m}) for every integer k >= 1.",
        f"Since {x} - {r} = {x - r} is divisible by {m}, {x} ≡ {r} (mod {m}); by Lemma 1.3 on "
        f"powers of congruent numbers, {x}^k ≡ {r}^k (mod {m}) for every k >= 1.",
        ["1.3"],
        "congruent",
    )


_DIGITS = range(2, 10)

_FAMILIES: list[tuple[Callable[..., tuple[str, str, list[str], str]], list[tuple[int, ...]]]] = [
    (_difference_of_powers, [(a,) for a in range(3, 203)]),
    (_consecutive_product, [(c,) for c in range(1, 201)]),
    (
        _linear_combination,
        [(d, m, n) for d in _DIGITS for m in _DIGITS for n in _DIGITS],
    ),
    (_coprime_neighbours, [(c,) for c in range(1, 201)]),
    (
        _congruent_powers,
        [(m, r, m * q + r) for m in range(3, 10) for r in range(1, m) for q in range(1, 6)],
    ),
]
"""Each family with its space of numbers; problem i is of family i mod 5."""

DISTINCT_PROBLEMS = len(_FAMILIES) * min(len(space) for _, space in _FAMILIES)
"""Problems 0 .. DISTINCT_PROBLEMS - 1 are all different (then they repeat)."""


@functools.cache
def _order(seed: int, family: int) -> list[int]:
    """A seeded permutation of the family's number space: the k-th problem of a family takes
    the k-th numbers of it, so different indices never ask the same question."""
    space = len(_FAMILIES[family][1])
    return random.Random(f"booknav-{seed}-{family}").sample(range(space), space)


def synthetic_problems(
    n: int, seed: int = 0, book: str = "book.json", first: int = 0
) -> list[BookTask]:
    """Problems first .. first + n - 1, cycling through the five families with numbers drawn
    from `seed`; disjoint index ranges share no problem (below `DISTINCT_PROBLEMS`)."""
    tasks = []
    for i in range(first, first + n):
        family = i % len(_FAMILIES)
        make, space = _FAMILIES[family]
        numbers = space[_order(seed, family)[(i // len(_FAMILIES)) % len(space)]]
        query, reference, sections, keyword = make(*numbers)
        tasks.append(
            BookTask(
                id=f"booknav-{seed}-{i}",
                query=query,
                book=book,
                reference_solution=reference,
                section_ids=sections,
                index_keyword=keyword,
            )
        )
    return tasks


def write_synthetic(directory: str | Path, n: int, seed: int = 0, first: int = 0) -> Path:
    """Write book.json and tasks.jsonl (problems first .. first + n - 1) into `directory`;
    returns the task file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "book.json").write_bytes(msgspec.json.encode(synthetic_book()))
    tasks_path = directory / "tasks.jsonl"
    write_tasks(tasks_path, synthetic_problems(n, seed, book="book.json", first=first))
    return tasks_path
