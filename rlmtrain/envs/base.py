"""What every environment provides, how its tasks are read, and how a config names one.

An environment is everything task-specific that the RLM runtime needs and nothing else: the
system prompt (strategy + tool docs), the per-turn user message, the context object put into the
REPL, the modules whose `TOOLS` lists are injected there, and the reward of finished trees. It
knows no engine and no model (docs/architecture.md), so the same env serves rollouts, teachers and
evaluation.

Tasks are msgspec Structs subclassing `Task` (an `id` and a `query`), one per JSONL line. A bad
line is an error naming file, line and field, never a skipped row: a silently shorter dataset is
a bug nobody sees.

Environments are found by name (`DataConfig.env`). The built-in ones register themselves when
their module is imported; `get_env` imports that module on first use, so importing this file
stays cheap and an environment's heavy dependencies load only when it is chosen.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import msgspec

from rlmtrain.config import ConfigError
from rlmtrain.errors import UserError
from rlmtrain.rlm.records import write_jsonl
from rlmtrain.run_folder import RunFolder

if TYPE_CHECKING:
    from rlmtrain.config import Config, RolloutConfig
    from rlmtrain.rlm.records import RolloutGroup

__all__ = [
    "Env",
    "RewardResult",
    "Split",
    "Task",
    "TaskFormatError",
    "available_envs",
    "check_env_name",
    "get_env",
    "read_tasks",
    "read_tasks_beside",
    "register_env",
    "root_answers",
    "write_tasks",
]


class Task(msgspec.Struct, kw_only=True):
    """The fields every task has; environments subclass it with their own (gold data etc.)."""

    id: str
    query: str
    """What the root trajectory must answer; restated in every turn's user message."""


class RewardResult(msgspec.Struct, kw_only=True):
    scores: list[float | None]
    """One score per root trajectory, in `group.roots` order; None = could not be scored
    (e.g. the judge failed), which the trainer must drop rather than read as 0."""
    details: list[dict[str, Any]] = []
    """Per-root diagnostics aligned with `scores` (method, precision, recall, ...); may be empty."""


class Env:
    """Base class of environments. Subclasses set `name` and `task_type` and override the methods.

    The runtime calls, per trajectory turn: `system_prompt()` once, `user_prompt(task, turn,
    max_turns)` every turn (rewritten, not accumulated: docs/algorithm.md §1), `context(task)`
    once per REPL, `tool_modules()` once per REPL zygote, and `reward(task, group)` once per
    finished group.
    """

    name: ClassVar[str] = ""
    task_type: ClassVar[type[Task]] = Task
    pass_metric: ClassVar[str | None] = None
    """For an env whose reward is a verdict (1 = pass): the name under which the evaluation
    reports the share of scored roots that pass; None for graded rewards."""
    prompt_style: str = "full"
    """"full" or "compact" (`rlm.prompts.PromptStyle`): the style of this env's strategy and root
    messages, matching `rollout.prompt_style` (the factory reads it from the config)."""

    def system_prompt(self) -> str:
        """The task strategy only; the runtime appends the tool and builtin docs (rlm/prompts)."""
        raise NotImplementedError(f"{type(self).__name__}.system_prompt")

    def user_prompt(self, task: Task, turn: int, max_turns: int) -> str:
        """The fresh user message of turn `turn` (0-based): the query and how many turns remain."""
        if self.prompt_style == "compact":
            from rlmtrain.rlm.prompts import compact_query_message

            return compact_query_message(task.query, turn, max_turns)
        left = max_turns - turn
        return (
            f"Query: {task.query}\n\n"
            f"This is turn {turn + 1} of {max_turns} ({left} left, this one included). "
            "Answer with one ```python block; end with FINAL(answer) or FINAL_VAR(name)."
        )

    def context(self, task: Task) -> Any:
        """The object bound to `context` in the REPL (plain data: dicts, lists, strings)."""
        raise NotImplementedError(f"{type(self).__name__}.context")

    def tool_modules(self) -> list[str]:
        """Importable module names; each defines `TOOLS`, the functions injected into the REPL.

        Such modules should import only the standard library: every REPL zygote imports them.
        """
        return []

    def tool_names(self) -> list[str]:
        """Names of the functions `tool_modules()` inject, in their modules' order."""
        from rlmtrain.rlm.tools import load_tools

        return list(load_tools(self.tool_modules()))

    async def reward(self, task: Task, group: RolloutGroup) -> RewardResult:
        """Score each root trajectory of `group` (children are never scored, docs/algorithm.md
        §3)."""
        raise NotImplementedError(f"{type(self).__name__}.reward")

    async def root_scores(
        self, tasks: list[Task], groups: list[RolloutGroup]
    ) -> list[list[float | None]]:
        """`reward(task, group).scores` of each task's group, in order. A root the scheduler
        could not run (`Trajectory.failure`: no REPL, an engine error) is unscored (None)
        whatever its reward says: its missing answer is the machine's, not the policy's, and as
        a 0 it would push down every token the policy sampled before the failure."""
        scores = []
        for task, group in zip(tasks, groups, strict=True):
            values = (await self.reward(task, group)).scores
            roots = group.roots
            if len(values) != len(roots):
                raise ValueError(
                    f"env {self.name}: {len(values)} scores for the {len(roots)} roots of a group"
                )
            scored = zip(roots, values, strict=True)
            scores.append([None if root.failure else value for root, value in scored])
        return scores

    def load_tasks(self, path: str | Path) -> list[Task]:
        """All tasks of a JSONL file, as this environment's task type."""
        return list(read_tasks(path, self.task_type))

    def synthesize(self, out_dir: Path, *, groups: int, first_group: int, config: Config) -> Path:
        """Make a task file (and whatever it names) in `out_dir` from groups first_group ..
        first_group + groups - 1 and return its path; for environments with a synthetic data
        set (disjoint group ranges share nothing). The others need task files."""
        raise ValueError(f"required: env '{self.name}' synthesises no tasks")

    def split_tasks(self, config: Config, split: Split) -> list[Task]:
        """The tasks of one of the run's three disjoint sets: "sft" (the teacher's slice), "rl"
        (training) and "eval" (held out). Each comes from its `data.*_path`, or else is
        synthesised into `<checkpoint.dir>/data/<split>` from its own range of groups (made
        once, remade when the data settings change). SFT without `sft_path` but with a
        `train_path` plays the training tasks. A missing, unusable or empty source is a
        ConfigError naming its key; a malformed line stays a TaskFormatError."""
        data = config.data
        key = {"sft": "sft_path" if data.sft_path else "train_path", "rl": "train_path"}
        key = key.get(split, "eval_path")
        try:
            path = getattr(data, key) or self._synthesized(config, split)
            tasks = self.load_tasks(path)
        except TaskFormatError:
            raise
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"data.{key}: {exc}") from None
        if not tasks:
            raise ConfigError(f"data.{key}: no {split} tasks in {path}")
        # A task's id names its trees (and seeds their sampling): two tasks of one id would
        # share them.
        twice = next((id_ for id_, n in Counter(t.id for t in tasks).items() if n > 1), None)
        if twice is not None:
            raise ConfigError(f"data.{key}: task id {twice!r} appears more than once in {path}")
        return tasks

    def _synthesized(self, config: Config, split: Split) -> Path:
        data = config.data
        groups = {"sft": data.sft_groups, "rl": data.synth_groups, "eval": data.eval_groups}
        first = {"sft": 0, "rl": data.sft_groups, "eval": data.sft_groups + data.synth_groups}
        out = RunFolder.of(config).data(split)
        made = {
            "env": self.name,
            "seed": data.seed,
            "groups": groups[split],
            "first_group": first[split],
            "max_papers": data.synth_max_papers,
        }
        stamp = out / "synth.json"
        path = out / "tasks.jsonl"
        if not (path.is_file() and stamp.is_file() and _read_json(stamp) == made):
            path = self.synthesize(
                out, groups=groups[split], first_group=first[split], config=config
            )
            stamp.write_text(msgspec.json.encode(made).decode() + "\n")
        return path

    def vocabulary_texts(self, tasks: list[Task]) -> list[str]:
        """The text a tokenizer trained for this env should compress: the prompts it will read
        and what the tasks hold (envs add their documents and the code their teachers write)."""
        return [self.system_prompt(), *(task.query for task in tasks)]

    def teacher(self, rollout: RolloutConfig) -> Callable[[str], str]:
        """The scripted teacher of the SFT warm-up (docs/algorithm.md §5): a reply that reads a
        rendered prompt as a policy would and answers with the turn's block of the expert's
        plan (`envs.teacher`), played through the scheduler by `rollout.teaching.teach`. A
        ConfigError where `rollout`'s limits cannot carry its trees, or the env has none."""
        raise ConfigError(
            f"train.sft_steps: env '{self.name}' has no scripted teacher; set it to 0"
        )


Split = Literal["sft", "rl", "eval"]


def _read_json(path: Path) -> Any:
    try:
        return msgspec.json.decode(path.read_bytes())
    except msgspec.DecodeError:
        return None


def root_answers(group: RolloutGroup) -> list[str | None]:
    """The final answer of each root trajectory, in `group.roots` order (None = no answer)."""
    return [root.answer for root in group.roots]


# ---------------------------------------------------------------------------------------------
# Task files
# ---------------------------------------------------------------------------------------------


class TaskFormatError(UserError, ValueError):
    """A malformed task line; the message names the file, the line and the field."""


T = TypeVar("T", bound=msgspec.Struct)


def read_tasks(path: str | Path, task_type: type[T]) -> Iterator[T]:
    """Yield one `task_type` per non-blank line of a JSONL file.

    Raises FileNotFoundError for a missing file and TaskFormatError ("file:line: field `$.x`:
    reason") for a line that is not JSON or does not match the Struct.
    """
    for _, task in _numbered_tasks(path, task_type):
        yield task


def _numbered_tasks(path: str | Path, task_type: type[T]) -> Iterator[tuple[int, T]]:
    decoder = msgspec.json.Decoder(task_type)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise TaskFormatError(f"{path}:{lineno}: {_name_field(str(exc))}") from None
            except msgspec.DecodeError as exc:
                raise TaskFormatError(f"{path}:{lineno}: not valid JSON: {exc}") from None


def read_tasks_beside(
    path: str | Path, task_type: type[T], path_field: str, *, folder: bool
) -> list[T]:
    """All tasks of a JSONL file, each task's `path_field` (a folder if `folder`, else a file)
    taken relative to the task file's folder unless absolute, so a data set can move as one
    folder; one that is not there is a TaskFormatError naming the line, before any work."""
    base = Path(path).parent
    tasks = []
    for lineno, task in _numbered_tasks(path, task_type):
        named = getattr(task, path_field)
        if not Path(named).is_absolute():
            task = msgspec.structs.replace(task, **{path_field: str(base / named)})
        where = Path(getattr(task, path_field))
        if not (where.is_dir() if folder else where.is_file()):
            raise TaskFormatError(
                f"{path}:{lineno}: field `{path_field}`: no {'folder' if folder else 'file'} "
                f"{where}"
            )
        tasks.append(task)
    return tasks


def _name_field(message: str) -> str:
    """'Expected `str`, got `int` - at `$.q`' -> 'field `$.q`: Expected `str`, got `int`'."""
    text, sep, where = message.partition(" - at ")
    if text.startswith("Object missing required field"):
        return f"missing field {text.split('`')[1]!r}" + (f" in {where}" if sep else "")
    return f"field {where}: {text}" if sep else text


def write_tasks(path: str | Path, tasks: list[msgspec.Struct]) -> int:
    """Write tasks as JSON lines (`write_jsonl`: written whole or not at all); returns how
    many were written."""
    return write_jsonl(path, tasks)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

EnvFactory = Callable[["Config | None"], Env]

_REGISTRY: dict[str, EnvFactory] = {}

# Built-in environments live in these modules and register on import.
_BUILTIN_MODULES = {
    "evidence": "rlmtrain.envs.evidence",
    "booknav": "rlmtrain.envs.booknav",
    "codenav": "rlmtrain.envs.codenav",
}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator registering `factory(config) -> Env` under `name`; a second, different
    registration of the same name is an error (two envs silently shadowing each other is not)."""

    def decorate(factory: EnvFactory) -> EnvFactory:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not factory:
            same = getattr(existing, "__qualname__", None) == getattr(factory, "__qualname__", "")
            same = same and existing.__module__ == factory.__module__
            if not same:
                raise ValueError(f"environment {name!r} is already registered by {existing!r}")
        _REGISTRY[name] = factory
        return factory

    return decorate


def available_envs() -> list[str]:
    """Names `get_env` accepts: those registered plus the built-in ones not imported yet."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def check_env_name(name: str) -> None:
    """Refuse a name `get_env` would not know, in the one line naming `data.env`."""
    if name not in available_envs():
        raise ConfigError(
            f"data.env: unknown environment {name!r}; known: {', '.join(available_envs())}"
        )


def get_env(name: str, config: Config | None = None) -> Env:
    """Build the environment registered as `name` with the run's config (None = defaults)."""
    check_env_name(name)
    if name not in _REGISTRY:
        importlib.import_module(_BUILTIN_MODULES[name])
    return _REGISTRY[name](config)
