"""Synthetic code bases for code navigation: small Python packages made from a seed.

A group is one package of a few modules, each holding a few functions whose bodies call one
another and a handful of builtins; the tasks of `codenav.generate_tasks` are then drawn from it.
Every package has a name of its own (its group number is in it), so disjoint group ranges share
no code and no task, and the held-out split asks about code the policy never saw. The sources
are deterministic in (seed, group): rerunning the synthesis rewrites the same files.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlmtrain.envs.synth_words import words

__all__ = ["package_sources", "write_packages"]

# fmt: off
_VERBS = words("load | parse | build | check | merge | split | scale | fetch | encode | decode | "
               "render | count | filter | sort | index | store | clean | score | pack | trace | "
               "align | group | rank | fold")
_NOUNS = words("record | table | token | frame | batch | graph | chunk | header | label | vector | "
               "field | cache | query | entry | path | sample | window | block | shard | bucket")
_MODULES = words("core | util | io | text | stats | model | store | plan")
_ARGUMENTS = words("items | rows | data | values | limit | size | text | name | keys | width")
_BUILTINS = words("len | sorted | sum | max | min | list | str | abs")
_PACKAGE_HEADS = words("atlas | birch | cedar | delta | ember | fjord | grove | harbor | iris | "
                       "juniper")
# fmt: on

MODULES_PER_PACKAGE = 3
FUNCTIONS_PER_MODULE = 4


def _function(name: str, rng: random.Random, callees: list[str]) -> list[str]:
    """The lines of one function: a few assignments, each a call, and a return of a call."""
    arguments = rng.sample(_ARGUMENTS, rng.randint(1, 2))
    lines = [f"def {name}({', '.join(arguments)}):"]
    names = list(arguments)
    picked = rng.sample(callees, min(len(callees), rng.randint(2, 4)))
    for i, callee in enumerate(picked[:-1]):
        target = f"{rng.choice(_NOUNS)}_{i}"
        lines.append(f"    {target} = {callee}({rng.choice(names)})")
        if rng.random() < 0.3:
            lines.append(f"    if not {target}:")
            lines.append(f"        return {rng.choice(names)}")
        names.append(target)
    lines.append(f"    return {picked[-1]}({', '.join(rng.sample(names, min(2, len(names))))})")
    return lines


def package_sources(seed: int, group: int) -> dict[str, str]:
    """{path: source} of group `group`'s package, paths starting with the package's name."""
    rng = random.Random(f"codenav-{seed}-{group}")
    package = f"{rng.choice(_PACKAGE_HEADS)}{group}"
    modules = rng.sample(_MODULES, MODULES_PER_PACKAGE)
    wanted = MODULES_PER_PACKAGE * FUNCTIONS_PER_MODULE
    names: list[str] = []
    while len(names) < wanted:
        name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
        if name not in names:
            names.append(name)
    owner = {name: modules[i // FUNCTIONS_PER_MODULE] for i, name in enumerate(names)}
    sources = {f"{package}/__init__.py": ""}
    for module in modules:
        own = [name for name in names if owner[name] == module]
        others = [name for name in names if owner[name] != module]
        imported = sorted(rng.sample(others, 3))
        lines: list[str] = []
        for source_module in sorted({owner[name] for name in imported}):
            from_there = [name for name in imported if owner[name] == source_module]
            lines.append(f"from {package}.{source_module} import {', '.join(from_there)}")
        for i, name in enumerate(own):
            # Earlier functions of the module, the imported ones and builtins are callable.
            callees = [*own[:i], *imported, *rng.sample(_BUILTINS, 3)]
            lines += ["", "", *_function(name, rng, callees)]
        sources[f"{package}/{module}.py"] = "\n".join(lines) + "\n"
    return sources


def write_packages(out_dir: str | Path, seed: int, groups: range) -> list[Path]:
    """Write each group's package under `out_dir`; returns the package directories."""
    out_dir = Path(out_dir)
    made = []
    for group in groups:
        sources = package_sources(seed, group)
        for path, source in sources.items():
            file = out_dir / path
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(source, encoding="utf-8")
        made.append(out_dir / next(iter(sources)).split("/")[0])
    return made
