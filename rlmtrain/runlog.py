"""Everything a user watches during a training run, behind one object the training script calls.

`RunLog` owns the run's outputs that are not checkpoints: `metrics.jsonl` (one row per optimizer
step), `eval.jsonl` (one report per held-out evaluation), `samples.jsonl` (a few rollout trees
per step as decoded text, to audit what the policy does), TensorBoard events under `tb/`, an
optional W&B run, a tqdm bar over the whole run, `curves.png` and the summary table printed last.
The script hands it plain rows and reports; nothing here computes a metric.

Every JSON line is flushed when written, so a killed run keeps its curve. The x axis everywhere
is the run's global step, the optimizer steps taken so far: SFT step k is k + 1, RL step k is
`train.sft_steps` + k + 1, an evaluation sits at the steps taken when it ran (init = 0). It is
derived from each row's phase and step, not counted, so a skipped SFT step leaves a gap instead
of shifting the rest.

TensorBoard is on by default and optional: when it is not installed, one info line says so and
the run goes on. W&B is opt-in, so `logging.wandb_project` without wandb installed is a
`ConfigError` — a configured feature never silently does nothing. `rank0=False` makes every
method a no-op (the config is still checked, so all ranks fail alike). Plots use matplotlib's
object API (`Figure`, no pyplot), which needs no display and leaves the global backend alone.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import math
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import msgspec
import torch

from rlmtrain.config import Config, ConfigError
from rlmtrain.rlm.records import RolloutGroup, Trajectory
from rlmtrain.run_folder import RunFolder

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["HAS_TENSORBOARD", "HAS_WANDB", "RunLog", "paired_gain"]

log = logging.getLogger("rlmtrain.runlog")

HAS_TENSORBOARD: bool = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB: bool = importlib.util.find_spec("wandb") is not None

_STEP_PHASES = ("sft", "rl")
_EVAL_PHASES = ("init", "sft", "rl", "final")
_NOT_SCALARS = ("phase", "step", "task_rewards")


def check_wandb(cfg: Config) -> None:
    """A W&B project needs wandb installed; refused in one line otherwise (a run that logged
    nowhere it was told to would be found out only after it ended)."""
    if cfg.logging.wandb_project and not HAS_WANDB:
        raise ConfigError(
            f"logging.wandb_project: '{cfg.logging.wandb_project}' is set but wandb is not "
            "installed (pip install wandb), or leave it empty"
        )


class RunLog:
    """The run's metrics, eval reports, sample trees, TensorBoard, W&B, progress bar and plot.

    run_dir: the run folder (`checkpoint.dir`); files go there, `metrics.jsonl` to
    `logging.metrics_path` when set. Files are opened in append mode on their first line.
    """

    def __init__(self, cfg: Config, run_dir: Path, *, rank0: bool = True) -> None:
        check_wandb(cfg)
        self._cfg = cfg
        folder = RunFolder(run_dir, cfg.logging.metrics_path)
        self._curves = folder.curves
        self._on = rank0
        self._closed = False
        self._position = 0
        self._sft_loss: list[tuple[int, float]] = []
        self._rl_reward: list[tuple[int, float]] = []
        self._evals: list[tuple[int, dict[str, Any]]] = []
        self._metrics = _JsonLines(folder.metrics)
        self._eval_file = _JsonLines(folder.evals)
        self._samples_file = _JsonLines(folder.samples)
        self._tb = None
        self._wandb = None
        self._bar = None
        if not rank0:
            return
        if cfg.logging.tensorboard:
            if HAS_TENSORBOARD:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(folder.tensorboard))
            else:
                log.info(
                    "logging: tensorboard is not installed, no events written (pip install "
                    "tensorboard, or set logging.tensorboard=false)"
                )
        if cfg.logging.wandb_project:
            import wandb

            self._wandb = wandb.init(
                project=cfg.logging.wandb_project,
                mode=cfg.logging.wandb_mode,
                dir=str(folder.root),
                name=folder.root.name,
                config=msgspec.to_builtins(cfg),
            )
        if cfg.logging.progress:
            from tqdm import tqdm

            total = cfg.train.sft_steps + cfg.train.steps
            self._bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)

    def start_fresh(self) -> None:
        """Empty the metrics, evaluations and samples an earlier run left in the folder."""
        self._keep_until(None)

    def resume_after(self, phase: str, steps_taken: int) -> None:
        """Line the files up with a run resumed after `steps_taken` steps of `phase`: what was
        recorded up to there is kept and taken back into the curves and the summary; what came
        after (the steps about to be redone) is dropped."""
        offset = 0 if phase == "sft" else self._cfg.train.sft_steps
        self._keep_until(offset + steps_taken)

    def evaluated(self, phase: str, step: int) -> bool:
        """Whether the evaluation of `phase` at `step` is on record (a resumed run does not redo
        it; a finished run given more steps has its end's evaluation at an earlier step)."""
        return any(
            report.get("phase") == phase and report.get("step") == step for _, report in self._evals
        )

    def _keep_until(self, position: int | None) -> None:
        if not self._on:
            return
        kept = {}
        for file in (self._metrics, self._eval_file, self._samples_file):
            rows = [] if position is None else [r for r in file.read() if self._at(r) <= position]
            file.rewrite(rows)
            kept[file] = rows
        for row in kept[self._metrics]:
            self._remember_step(row, self._at(row), _scalars(row, prefix=row.get("phase")))
        for report in kept[self._eval_file]:
            at = int(report.pop("global_step", 0) or 0)
            self._evals.append((at, report))
        if self._bar is not None:
            self._bar.update(self._position)

    def _at(self, row: dict[str, Any]) -> int:
        if "global_step" in row:
            return int(row["global_step"])
        return self._global_step(row.get("phase"), row.get("step"))

    # ------------------------------------------------------------------ per step

    def step(self, row: dict[str, Any]) -> None:
        """One optimizer step's row: at least "phase" ("sft" | "rl") and "step" (0-based).

        The whole row becomes one line of metrics.jsonl; its int/float/bool values (nested dicts
        flattened, as in finish_reasons) go to TensorBoard and W&B as "<phase>/<key>[/<sub>]".
        """
        if not self._on:
            return
        phase, step = row.get("phase"), row.get("step")
        position = self._global_step(phase, step)
        self._metrics.write(row)
        scalars = _scalars(row, prefix=phase)
        self._scalars_out(scalars, position)
        self._remember_step(row, position, scalars)
        if self._bar is not None:
            self._bar.set_description(phase, refresh=False)
            self._bar.set_postfix_str(_bar_postfix(row), refresh=False)
            self._bar.update(max(0, position - self._bar.n))

    def _remember_step(self, row: dict[str, Any], position: int, scalars: dict[str, float]) -> None:
        """A step's place in the curves the plot and the summary draw."""
        self._position = max(self._position, position)
        phase = row.get("phase")
        if phase == "sft" and "sft/loss" in scalars:
            self._sft_loss.append((position, scalars["sft/loss"]))
        if phase == "rl" and "reward_mean" in row:
            self._rl_reward.append((position, _float(row["reward_mean"])))

    def histograms(self, phase: str, step: int, **values: Sequence[float] | torch.Tensor) -> None:
        """TensorBoard (and W&B) histograms "<phase>/<name>" at the step's global step, e.g.
        `histograms("rl", step, advantage=adv, response_length=lengths)`; empty ones skipped."""
        if not self._on or (self._tb is None and self._wandb is None):
            return
        position = self._global_step(phase, step)
        for name, data in values.items():
            flat = torch.as_tensor(data).detach().float().flatten().cpu()
            if flat.numel() == 0:
                continue
            if self._tb is not None:
                self._tb.add_histogram(f"{phase}/{name}", flat, position)
            if self._wandb is not None:
                import wandb

                self._wandb.log({f"{phase}/{name}": wandb.Histogram(flat.numpy())}, step=position)

    def samples(
        self,
        phase: str,
        step: int,
        groups: list[RolloutGroup],
        scores: list[list[float | None]],
    ) -> None:
        """The first `logging.sample_trees` trees (groups in order, roots by sample_idx) as JSON
        lines of samples.jsonl. scores[g][i] is the score of groups[g].roots[i]."""
        if not self._on or self._cfg.logging.sample_trees == 0:
            return
        position = self._global_step(phase, step)
        written = 0
        for group, group_scores in zip(groups, scores, strict=True):
            for root, score in zip(group.roots, group_scores, strict=True):
                if written == self._cfg.logging.sample_trees:
                    return
                self._samples_file.write(
                    {
                        "phase": phase,
                        "step": step,
                        "global_step": position,
                        "task_id": root.task_id,
                        "root_id": root.id,
                        "score": score,
                        "trajectories": [_decoded(t) for t in group.tree(root)],
                    }
                )
                written += 1

    # ------------------------------------------------------------------ evaluation

    def eval(self, report: dict[str, Any]) -> None:
        """One held-out evaluation: phase ('init' | 'sft' | 'rl' | 'final'), step, reward_mean,
        tasks, children_per_root, spawn_rate and whatever else the evaluator measured. Goes to
        eval.jsonl (with the global step it ran at), TensorBoard and W&B as "eval/<key>", and is
        kept for `summary_table` and the plot."""
        if not self._on:
            return
        phase = report.get("phase")
        if phase not in _EVAL_PHASES:
            raise ValueError(f"eval report phase {phase!r} is not one of {_EVAL_PHASES}")
        self._eval_file.write({**report, "global_step": self._position})
        self._scalars_out(_scalars(report, prefix="eval"), self._position)
        self._evals.append((self._position, dict(report)))

    def summary_table(self) -> str:
        """The evaluations as an aligned plain-text table, in the order they ran; '' if none.
        The pass@k header takes k from the last report's "pass_k", else `eval.samples`; a row
        sampled with another k (`eval.init_samples`) names its own, as in "0.000 @1". A reward
        shows its standard error over tasks ("0.707 ± 0.041") where the report has one, and
        lines under the table give the gains from one named stage to the next (`_paired_gains`)."""
        if not self._evals:
            return ""
        with_pass = any("pass_at_k" in report for _, report in self._evals)
        header = ["stage", "step", "held-out reward"]
        ks = [r["pass_k"] for _, r in self._evals if "pass_k" in r]
        k = ks[-1] if ks else self._cfg.eval.samples
        header += [f"pass@{k}"] if with_pass else []
        header += ["spawn rate", "multi-paper spawn", "children/root", "tasks"]
        columns = ("spawn_rate", "spawn_rate_multi", "children_per_root", "tasks")
        lines = [header]
        for (stage, _), (position, report) in zip(self._stages(), self._evals, strict=True):
            cells = [stage, str(position), _reward_cell(report)]
            if with_pass:
                own = report.get("pass_k", k)
                cell = _cell(report.get("pass_at_k"))
                cells.append(cell if own == k else f"{cell} @{own}")
            cells += [_cell(report.get(column)) for column in columns]
            lines.append(cells)
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        rows = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
            for line in lines
        ]
        rows.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(rows + self._paired_gains())

    def _paired_gains(self) -> list[str]:
        """A line per two named evaluations in a row (init -> after SFT -> after RL): the mean
        of the per-task differences over the tasks both scored, and its standard error. Paired,
        the error leaves out how hard each task is, which both evaluations share, and keeps
        the trees' sampling noise and how the gain varies over tasks: a gain more than two errors
        above zero is unlikely to be the draw's. A report without per-task means (an older
        eval.jsonl) is left out."""
        named = [
            (stage, report)
            for (stage, mid_run), (_, report) in zip(self._stages(), self._evals, strict=True)
            if not mid_run and report.get("task_rewards")
        ]
        lines = []
        for (before, earlier), (after, later) in itertools.pairwise(named):
            paired = paired_gain(earlier, later)
            if paired is not None:
                gain, stderr, tasks = paired
                lines.append(
                    f"{before} -> {after}: {gain:+.3f} ± {stderr:.3f} (mean per-task difference "
                    f"over the {tasks} tasks both scored ± its standard error)"
                )
        return lines

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Close the bar, TensorBoard, W&B and the files; write curves.png when `logging.plot`."""
        if not self._on or self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        for f in (self._metrics, self._eval_file, self._samples_file):
            f.close()
        if self._cfg.logging.plot:
            # A mid-run evaluation's point goes unnamed: the axis gives its step.
            evals = [
                (position, report, None if mid_run else stage)
                for (position, report), (stage, mid_run) in zip(
                    self._evals, self._stages(), strict=True
                )
            ]
            _figure(self._sft_loss, self._rl_reward, evals).savefig(self._curves, dpi=100)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # A failure while closing must not replace the error that ended the run.
        try:
            self.close()
        except Exception:
            log.exception("logging: closing the run log failed")

    # ------------------------------------------------------------------ helpers

    def _global_step(self, phase: Any, step: Any) -> int:
        if phase not in _STEP_PHASES:
            raise ValueError(f"step phase {phase!r} is not one of {_STEP_PHASES}")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        offset = 0 if phase == "sft" else self._cfg.train.sft_steps
        return offset + step + 1

    def _scalars_out(self, scalars: dict[str, float], position: int) -> None:
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, position)
            self._tb.flush()
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=position)

    def _stages(self) -> list[tuple[str, bool]]:
        """Each evaluation's name, and whether it was made mid-run: at an RL step, or at an end
        that a finished run given more RL steps went on from (named by its step, then)."""
        finals = [i for i, (_, report) in enumerate(self._evals) if report["phase"] == "final"]
        out = []
        for i, (_, report) in enumerate(self._evals):
            phase = report["phase"]
            if phase == "rl" or i in finals[:-1]:
                out.append((f"RL step {report.get('step', '?')}", True))
            elif phase == "final":
                out.append(("after RL" if self._cfg.train.steps else "final", False))
            else:
                out.append(({"init": "init", "sft": "after SFT"}[phase], False))
        return out


class _JsonLines:
    """A JSON-lines file opened for append on its first line and flushed after every line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None

    def write(self, obj: Any) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # noqa: SIM115 - lives as long as the run
        self._file.write(msgspec.json.encode(obj) + b"\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def read(self) -> list[dict[str, Any]]:
        """Every complete line written so far (a line cut short by a kill is left out)."""
        if not self.path.is_file():
            return []
        rows = []
        for line in self.path.read_bytes().splitlines():
            try:
                rows.append(msgspec.json.decode(line))
            except msgspec.DecodeError:
                continue
        return rows

    def rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Replace the file's lines with `rows` (atomically: written beside, then renamed)."""
        self.close()
        if not rows and not self.path.exists():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))
        os.replace(partial, self.path)


def _scalars(row: dict[str, Any], prefix: str) -> dict[str, float]:
    """int/float/bool values as "<prefix>/<key>", nested dicts as "<prefix>/<key>/<sub>"."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in _NOT_SCALARS:
            continue
        tag = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(_scalars(value, tag))
        elif isinstance(value, bool | int | float):
            out[tag] = float(value)
    return out


def _bar_postfix(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']}"]
    if "reward_mean" in row:
        parts.append(f"reward {row['reward_mean']:.3f}")
    if row.get("tokens") and row.get("seconds"):
        parts.append(f"{row['tokens'] / row['seconds']:,.0f} tok/s")
    elif "engine_tokens_per_s" in row:
        parts.append(f"{row['engine_tokens_per_s']:,.0f} tok/s")
    return ", ".join(parts)


def _decoded(t: Trajectory) -> dict[str, Any]:
    return {
        "id": t.id,
        "parent_id": t.parent_id,
        "depth": t.depth,
        "prompt": t.prompt,
        "finish_reason": t.finish_reason,
        "answer": t.answer,
        "turns": [
            {"code": turn.code, "output": turn.output, "error": turn.error} for turn in t.turns
        ],
    }


def paired_gain(earlier: dict[str, Any], later: dict[str, Any]) -> tuple[float, float, int] | None:
    """From one evaluation report to a later one: the mean of their per-task differences
    ("task_rewards") over the tasks both scored, its standard error, and the count of those
    tasks; None under two such tasks (or a report without per-task means)."""
    before, after = earlier.get("task_rewards") or {}, later.get("task_rewards") or {}
    differences = [after[task] - before[task] for task in sorted(before.keys() & after.keys())]
    if len(differences) < 2:
        return None
    stderr = statistics.stdev(differences) / math.sqrt(len(differences))
    return sum(differences) / len(differences), stderr, len(differences)


def _reward_cell(report: dict[str, Any]) -> str:
    """The held-out reward, with its standard error over tasks where the report has one."""
    cell = _cell(report.get("reward_mean"))
    stderr = report.get("reward_stderr")
    return cell if stderr is None else f"{cell} ± {stderr:.3f}"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3f}"
    if isinstance(value, dict):
        return " ".join(f"{k}:{_cell(v)}" for k, v in value.items())
    return str(value)


def _figure(
    sft_loss: list[tuple[int, float]],
    rl_reward: list[tuple[int, float]],
    evals: list[tuple[int, dict[str, Any], str | None]],
) -> Figure:
    """Two panels over the global step: training curves (RL reward, SFT loss on its own axis),
    then every evaluation's held-out reward and spawn rate, each point with its name, if any."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 7), layout="constrained")
    train_ax, eval_ax = fig.subplots(2, 1, sharex=True)

    handles = []
    if rl_reward:
        handles += train_ax.plot(*zip(*rl_reward, strict=True), ".-", label="RL reward_mean")
    train_ax.set_ylabel("reward")
    if sft_loss:
        loss_ax = train_ax.twinx()
        handles += loss_ax.plot(
            *zip(*sft_loss, strict=True), ".-", color="tab:orange", label="SFT loss"
        )
        loss_ax.set_ylabel("SFT loss")
    if handles:
        train_ax.legend(handles=handles, loc="best")
    else:
        train_ax.text(
            0.5, 0.5, "no training steps", ha="center", va="center", transform=train_ax.transAxes
        )
    train_ax.set_title("training")

    if evals:
        xs = [position for position, _, _ in evals]
        for key, label in (("reward_mean", "held-out reward_mean"), ("spawn_rate", "spawn rate")):
            ys = [_float(report.get(key)) for _, report, _ in evals]
            eval_ax.plot(xs, ys, "o-", label=label)
        for position, report, name in evals:
            y = _float(report.get("reward_mean"))
            if name is None or math.isnan(y):
                continue
            eval_ax.annotate(
                name,
                (position, y),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
        eval_ax.legend(loc="best")
    else:
        eval_ax.text(
            0.5, 0.5, "no evaluation", ha="center", va="center", transform=eval_ax.transAxes
        )
    eval_ax.set_title("held-out evaluation")
    eval_ax.set_xlabel("global step (optimizer steps taken)")
    return fig


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")
