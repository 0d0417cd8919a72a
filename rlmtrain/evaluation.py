"""Held-out evaluation (docs/algorithm.md §5): k trees per task, scored, summarised in one report.

`evaluate` rolls the held-out tasks out through the same `Scheduler`, engine and environment as
training, so an evaluation measures the policy exactly as RL samples it (temperature and top-p of
`rollout`), and scores roots with the environment's own reward (`env.root_scores`: the judge when
one is configured, span F1 otherwise). `summarize` turns the trees and scores into numbers; it
reads only the trainer-side records (`rlm.records`), never engine counters, so the same groups
always give the same report.

Reproducibility: the scheduler's sampling seed is `eval.seed`, and the agent derives each
request's seed from it, the trajectory id and the turn (`Agent.params`); the native engine draws
each request with its own generator. Same weights + seed + tasks give the same trees, hence the
same report except the wall-clock keys in `TIMING_KEYS` (on the CPU exactly: the native engine
gives a request the same bits in any batch and from its prefix cache; on a GPU its kernels'
shape-dependent last bits can flip a near-tie draw).
`sample_digest` (a CRC of every sampled token id) makes that checkable at a glance: two reports
sampled the same tokens when their digests agree.

Choices: pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1) over each task's scored roots, with "pass" = score >= `pass_threshold`
(0.5 by default: the rewards here are continuous, span F1 or a judge score in [0, 1]). A root the
reward could not score (None) is left out of the means and of pass@k and counted in `unscored`,
never read as 0. `reward_stderr` is the held-out reward's sampling error: the tasks are the
sample (each task's scored roots averaged first, as the roots of one task are not independent
draws), so it counts both the trees a task happened to sample and which tasks were held out;
`task_rewards` keeps each task's mean by id, so two reports of one task set can be compared task
by task (the closing table's paired gains, `RunLog.summary_table`). `reward_by_kind` is the
mean root score per query family (a task's `kind`, e.g. the evidence env's datasets /
baselines / results / limitation): a policy that has learnt three families and not the fourth
shows it here, where the overall mean hides it. Metrics that do not apply (span F1 without gold
evidence, spawn rate over multi-paper tasks when there are none, per-kind means when no task
has a kind) are None, not 0.

Per method. Tool use, BookNavigator's measure of whether RL kept the model using its tools:
`tool_calls_per_trajectory` counts calls of the env's own tools (`Env.tool_names`) per
trajectory, children included, and `distinct_tool_share` is the mean over trajectories of the
share of those tools each used at least once. The step rubric of LongTraceRL
(`rewards.step_rubric`, its heuristic) gives `step_relevance`, `step_info_gain` and
`step_coherence`, means over every turn. An env whose reward is a verdict names its pass rate
(`Env.pass_metric`: booknav's `proof_pass_rate`, the share of scored roots the judge passed).
"""

from __future__ import annotations

import math
import statistics
import time
import zlib
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlmtrain.errors import UserError
from rlmtrain.rewards.step_rubric import STEP_CRITERIA, heuristic_step_scores
from rlmtrain.rlm.code_calls import SUBQUERY_BUILTINS
from rlmtrain.rlm.records import RolloutGroup, Trajectory, failed_everywhere

if TYPE_CHECKING:
    from rlmtrain.config import Config
    from rlmtrain.envs.base import Env
    from rlmtrain.model.tokenizer import Tokenizer
    from rlmtrain.model.transformer import Transformer
    from rlmtrain.rollout.engine import Engine

__all__ = [
    "DEFAULT_PASS_THRESHOLD",
    "SPAWN_TOOLS",
    "TIMING_KEYS",
    "evaluate",
    "format_report",
    "pass_at_k",
    "spawned",
    "summarize",
]

DEFAULT_PASS_THRESHOLD = 0.5
SPAWN_TOOLS = SUBQUERY_BUILTINS
TIMING_KEYS = ("wall_s_per_tree", "seconds")
"""Report keys measured by the wall clock; every other key is a function of the sampled trees."""


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n - c, k) / C(n, k); needs k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(
    tasks: Sequence[Any],
    groups: Sequence[RolloutGroup],
    scores: Sequence[Sequence[float | None]],
    *,
    samples: int,
    seconds: float,
    pass_threshold: float = DEFAULT_PASS_THRESHOLD,
    tools: Sequence[str] = (),
    pass_metric: str | None = None,
) -> dict[str, Any]:
    """The evaluation report of `groups` (one per task, G = `samples` roots each) and their root
    scores (`scores[i]` in `groups[i].roots` order). See the module docstring for the choices;
    `seconds` is the caller's wall time of the whole evaluation; `tools` the env's tool names and
    `pass_metric` its verdict pass rate's name (`Env.tool_names`, `Env.pass_metric`)."""
    if not len(tasks) == len(groups) == len(scores):
        raise ValueError(
            f"summarize: {len(tasks)} tasks, {len(groups)} groups, {len(scores)} score lists"
        )
    roots: list[Trajectory] = []
    children: list[Trajectory] = []
    root_scores: list[float] = []
    unscored = 0
    task_pass: list[float] = []
    task_pass_1: list[float] = []
    task_means: list[float] = []
    task_rewards: dict[str, float] = {}
    span_scores: list[float] = []
    spawned_multi: list[bool] = []
    kind_scores: dict[str, list[float]] = {}
    for task, group, values in zip(tasks, groups, scores, strict=True):
        group_roots = group.roots
        if len(values) != len(group_roots):
            raise ValueError(
                f"summarize: task {_task_id(task)!r} has {len(group_roots)} roots but "
                f"{len(values)} scores"
            )
        roots.extend(group_roots)
        children.extend(t for t in group.trajectories if not t.is_root)
        scored = [v for v in values if v is not None]
        unscored += len(values) - len(scored)
        root_scores.extend(scored)
        if kind := getattr(task, "kind", ""):
            kind_scores.setdefault(kind, []).extend(scored)
        if scored:
            passed = sum(v >= pass_threshold for v in scored)
            task_pass.append(pass_at_k(len(scored), passed, min(samples, len(scored))))
            task_pass_1.append(passed / len(scored))
            task_means.append(sum(scored) / len(scored))
            task_rewards[_task_id(task)] = task_means[-1]
        evidence = getattr(task, "evidence", None)
        if evidence is not None:
            from rlmtrain.rewards.span_f1 import span_f1

            truth = [span.text for span in evidence]
            span_scores.extend(
                0.0 if r.answer is None else span_f1(r.answer, truth) for r in group_roots
            )
        if len(getattr(task, "paper_ids", ())) > 1:
            spawned_multi.extend(spawned(root) for root in group_roots)

    descendants = Counter(t.root_id for t in children)
    everyone = [*roots, *children]
    tool_calls: Counter[str] = Counter()
    for trajectory in everyone:
        for turn in trajectory.turns:
            tool_calls.update(call.name for call in turn.tool_calls)
    tree_walls = _tree_walls(groups)
    verdict: dict[str, Any] = {"pass_metric": pass_metric}
    if pass_metric is not None:
        verdict[pass_metric] = _mean([float(v >= 1.0) for v in root_scores])
    return {
        "tasks": len(tasks),
        "samples": samples,
        "roots": len(roots),
        "reward_mean": _mean(root_scores),
        "reward_stderr": _standard_error(task_means),
        "task_rewards": task_rewards,
        "reward_by_kind": (
            {kind: _mean(kind_scores[kind]) for kind in sorted(kind_scores)}
            if kind_scores
            else None
        ),
        "unscored": unscored,
        "pass_k": samples,
        "pass_threshold": pass_threshold,
        "pass_at_k": _mean(task_pass),
        "pass_at_1": _mean(task_pass_1),
        "span_f1": _mean(span_scores),
        "turns_mean": _mean([len(r.turns) for r in roots]),
        "turns_per_trajectory": _mean([len(t.turns) for t in everyone]),
        "children_per_root": _mean([descendants[r.id] for r in roots]),
        "spawn_rate": _mean([float(spawned(r)) for r in roots]),
        "spawn_rate_multi": _mean([float(s) for s in spawned_multi]),
        "finish_reasons": {
            "roots": dict(sorted(Counter(r.finish_reason for r in roots).items())),
            "children": dict(sorted(Counter(t.finish_reason for t in children).items())),
        },
        "tool_calls": dict(sorted(tool_calls.items())),
        **_tool_use(everyone, tools),
        **_step_rubric_means(everyone),
        **verdict,
        "generated_tokens": sum(len(turn.completion_ids) for t in everyone for turn in t.turns),
        "sample_digest": sample_digest(groups),
        "wall_s_per_tree": _mean(tree_walls),
        "seconds": seconds,
    }


def _tool_use(trajectories: Sequence[Trajectory], tools: Sequence[str]) -> dict[str, Any]:
    """Calls of the env's tools per trajectory, and the mean share of them each one used."""
    if not tools or not trajectories:
        return {"tool_calls_per_trajectory": None, "distinct_tool_share": None}
    known = set(tools)
    calls, shares = [], []
    for trajectory in trajectories:
        names = [c.name for turn in trajectory.turns for c in turn.tool_calls if c.name in known]
        calls.append(len(names))
        shares.append(len(set(names)) / len(known))
    return {"tool_calls_per_trajectory": _mean(calls), "distinct_tool_share": _mean(shares)}


def _step_rubric_means(trajectories: Sequence[Trajectory]) -> dict[str, float | None]:
    """The heuristic step rubric's criteria, each a mean over every turn."""
    scores = [s for t in trajectories for s in heuristic_step_scores(t.prompt, t.turns)]
    return {f"step_{name}": _mean([getattr(s, name) for s in scores]) for name in STEP_CRITERIA}


def spawned(root: Trajectory) -> bool:
    """Whether the root called rlm_query[_batched]: it has children (the agent records each
    before spawning it), or a turn's code called one and every prompt was refused by a limit."""
    if root.children:
        return True
    return any(call.name in SPAWN_TOOLS for turn in root.turns for call in turn.tool_calls)


def _tree_walls(groups: Sequence[RolloutGroup]) -> list[float]:
    """Per tree: the first turn's start to the last turn's end over all its trajectories."""
    spans: dict[str, tuple[float, float]] = {}
    for group in groups:
        for trajectory in group.trajectories:
            for turn in trajectory.turns:
                if turn.started <= 0 or turn.ended <= 0:
                    continue
                began, ended = spans.get(trajectory.root_id, (math.inf, -math.inf))
                spans[trajectory.root_id] = (min(began, turn.started), max(ended, turn.ended))
    return [ended - began for began, ended in spans.values()]


def sample_digest(groups: Sequence[RolloutGroup]) -> str:
    """CRC-32 (hex) of every trajectory id and its turns' completion token ids, in id order."""
    crc = 0
    for group in groups:
        for trajectory in sorted(group.trajectories, key=lambda t: t.id):
            crc = zlib.crc32(trajectory.id.encode(), crc)
            for turn in trajectory.turns:
                crc = zlib.crc32(array("q", turn.completion_ids).tobytes(), crc)
                crc = zlib.crc32(b"|", crc)
    return f"{crc:08x}"


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _standard_error(values: Sequence[float]) -> float | None:
    """The standard error of `values`' mean (sample deviation over the square root of the
    count); None under two values, where it is not defined."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def _task_id(task: Any) -> str:
    return getattr(task, "id", None) or str(task)


# ---------------------------------------------------------------------------------------------
# Rolling out
# ---------------------------------------------------------------------------------------------


async def evaluate(
    cfg: Config,
    model: Transformer,
    tokenizer: Tokenizer,
    env: Env,
    tasks: Sequence[Any],
    *,
    engine: Engine | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Roll out `tasks` (the first `eval.tasks` when > 0), `eval.samples` trees each, seeded by
    `eval.seed`; score the roots with `env`; return `summarize(...)`.

    engine: a running engine already serving `model`'s weights (the training run's; `model` is
    then not read); None = a fresh one from `build_engine(cfg, tokenizer)`, started empty,
    given `model`'s weights and closed after. The evaluation runs its own Scheduler: no hook of the
    caller's scheduler is touched.
    progress: a tqdm bar over trees on stderr.
    """
    from rlmtrain.model.hf import named_hf_tensors

    tasks = evaluated_tasks(cfg, tasks)
    began = time.perf_counter()
    owned = engine is None
    if engine is None:
        from rlmtrain.rollout.engines import build_engine

        engine = build_engine(cfg, tokenizer, weights="sync")
    try:
        if owned:
            await engine.update_weights(named_hf_tensors(model))
        groups = await roll_out(
            cfg, tokenizer, env, tasks, engine, per_task=cfg.eval.samples, progress=progress
        )
    finally:
        if owned:
            await engine.close()
    failure = failed_everywhere(groups) if owned else None
    if failure:  # an evaluation of its own, whose report would read as a policy scoring 0
        raise UserError(f"no tree could run: {failure}")
    return await report(
        cfg, env, tasks, groups, seconds=time.perf_counter() - began, per_task=cfg.eval.samples
    )


def trees_per_task(cfg: Config, phase: str) -> int:
    """k, the trees an evaluation samples per task: `eval.init_samples` at "init" when set,
    else `eval.samples`."""
    if phase == "init" and cfg.eval.init_samples:
        return cfg.eval.init_samples
    return cfg.eval.samples


def evaluated_tasks(cfg: Config, tasks: Sequence[Any]) -> list[Any]:
    """The held-out tasks an evaluation rolls out: the first `eval.tasks` when > 0."""
    chosen = list(tasks[: cfg.eval.tasks] if cfg.eval.tasks > 0 else tasks)
    if not chosen:
        raise ValueError("evaluate: no held-out tasks")
    return chosen


async def roll_out(
    cfg: Config,
    tokenizer: Tokenizer,
    env: Env,
    tasks: Sequence[Any],
    engine: Engine,
    *,
    per_task: int,
    samples: Sequence[Sequence[int]] | None = None,
    progress: bool = False,
) -> list[RolloutGroup]:
    """The evaluation's trees of `tasks` on `engine` (serving the policy): `per_task` roots a
    task (`trees_per_task`), or the indices `samples` names (a share of them dealt to this rank),
    seeded by `eval.seed` so a root is the same tree on any engine."""
    from rlmtrain.rollout.engine import SamplingParams
    from rlmtrain.rollout.scheduler import Scheduler

    sampling = SamplingParams(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=cfg.eval.seed
    )
    scheduler = Scheduler(engine, tokenizer, cfg.rollout, sampling=sampling)
    bar = None
    if progress:
        from rlmtrain.rollout.progress import RolloutProgress

        trees = len(tasks) * per_task if samples is None else sum(map(len, samples))
        bar = RolloutProgress(trees, engine)
        scheduler.on_tree_done = bar.tree_done
    try:
        return await scheduler.rollout(tasks, env, per_task, samples=samples)
    finally:
        if bar is not None:
            bar.close()


async def report(
    cfg: Config,
    env: Env,
    tasks: Sequence[Any],
    groups: list[RolloutGroup],
    *,
    seconds: float,
    per_task: int,
) -> dict[str, Any]:
    """The evaluation's report of whole groups of `per_task` roots: the roots scored by
    `env`, `summarize`d."""
    scores = await env.root_scores(tasks, groups)
    return summarize(
        tasks,
        groups,
        scores,
        samples=per_task,
        seconds=seconds,
        tools=env.tool_names(),
        pass_metric=env.pass_metric,
    )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def format_report(report: dict[str, Any]) -> str:
    """The report as an aligned two-column table (None shows as '-')."""
    k, threshold = report["pass_k"], report["pass_threshold"]
    rows = [
        (
            "reward mean",
            _num(report["reward_mean"])
            + _plus_minus(report.get("reward_stderr"))
            + f"  ({report['unscored']} unscored)",
        ),
        ("reward by query kind", _by_kind(report["reward_by_kind"])),
        (f"pass@{k} (score >= {threshold:g})", _num(report["pass_at_k"])),
        (f"pass@1 (score >= {threshold:g})", _num(report["pass_at_1"])),
        ("span F1", _num(report["span_f1"])),
        ("turns per root", _num(report["turns_mean"], 2)),
        ("turns per trajectory", _num(report["turns_per_trajectory"], 2)),
        ("children per root", _num(report["children_per_root"], 2)),
        ("spawn rate", _percent(report["spawn_rate"])),
        ("spawn rate, multi-paper", _percent(report["spawn_rate_multi"])),
        ("finish (roots)", _counts(report["finish_reasons"]["roots"])),
        ("finish (children)", _counts(report["finish_reasons"]["children"])),
        ("tool calls", _counts(report["tool_calls"])),
        ("tool calls per trajectory", _num(report["tool_calls_per_trajectory"], 2)),
        ("distinct tools used", _percent(report["distinct_tool_share"])),
        (
            "step rubric",
            " ".join(f"{name}={_num(report[f'step_{name}'], 3)}" for name in STEP_CRITERIA),
        ),
        ("generated tokens", str(report["generated_tokens"])),
        ("wall s per tree", _num(report["wall_s_per_tree"], 2)),
        ("sample digest", report["sample_digest"]),
    ]
    title = (
        f"{report.get('phase', 'eval')} step {report.get('step', 0)}: {report['tasks']} tasks "
        f"x {report['samples']} samples ({report['roots']} roots) in {report['seconds']:.1f} s"
    )
    if verdict := report.get("pass_metric"):
        rows.append((verdict.replace("_", " "), _percent(report[verdict])))
    width = max(len(name) for name, _ in rows)
    return "\n".join([title, *(f"  {name:<{width}}  {value}" for name, value in rows)])


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _plus_minus(stderr: float | None) -> str:
    return "" if stderr is None else f" ± {stderr:.4f} (standard error over tasks)"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _by_kind(means: dict[str, float | None] | None) -> str:
    return " ".join(f"{kind}={_num(mean, 3)}" for kind, mean in (means or {}).items()) or "-"


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{name}={n}" for name, n in counts.items()) or "-"
