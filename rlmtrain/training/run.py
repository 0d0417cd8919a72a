"""The run object: what the phases of one training run share, and what they do to it alike
(evaluate the held-out tasks, save a checkpoint, keep the engine's weights current, export).

`startup.start_run` makes it; `sft.sft_phase` and `rl.rl_phase` take it whole, so a phase's
signature is its own settings, not the run's twelve parts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import torch

from rlmtrain import checkpointing, parallel, watchdog
from rlmtrain.config import Config
from rlmtrain.envs.base import Env, Task
from rlmtrain.evaluation import evaluated_tasks, report, roll_out, trees_per_task
from rlmtrain.model import Transformer, save_hf
from rlmtrain.model.bpe import tokenizer_files
from rlmtrain.model.hf import hf_named
from rlmtrain.model.tokenizer import Tokenizer
from rlmtrain.rlm.records import failed_everywhere
from rlmtrain.rollout import dealing
from rlmtrain.rollout.engine import Engine
from rlmtrain.run_folder import RunFolder
from rlmtrain.runlog import RunLog
from rlmtrain.training.steps import DTYPES

log = logging.getLogger("rlmtrain.train")


class TaskSets(NamedTuple):
    """The env's three disjoint task sets (`Env.split_tasks`)."""

    sft: list[Task]
    rl: list[Task]
    held_out: list[Task]


class EngineSync:
    """Sends the policy's weights to the engine when they changed since the last send: every
    rank streams the parameters, each gathered whole from the shards as its engine takes it
    (`parallel.full_parameters`, the ranks in lockstep), into its own engine.

    Colocated (`rollout.colocate`), it also lends the GPU to the trainer: `release` puts vLLM
    to sleep before a train step, at level 2 (weights and KV cache freed, nothing copied to the
    host: the sync resends every weight, and each vLLM worker checks that none is missing), and
    the next call wakes it in two phases, the weights, then the sync, then the KV cache, so the
    buckets in transit never share the GPU with a KV cache. Requests wait while it sleeps.
    """

    def __init__(self, engine: Engine, model: torch.nn.Module, *, colocate: bool) -> None:
        self._engine = engine
        self._model = model
        self._colocate = colocate
        self._current = False
        self._asleep = False

    def stale(self) -> None:
        self._current = False

    async def release(self) -> None:
        if self._colocate and not self._asleep:
            await self._engine.sleep(level=2)
            self._asleep = True
            self._current = False

    async def __call__(self) -> None:
        if self._asleep:
            # What the train step freed goes back to the driver first: the engine allocates
            # outside torch's cache and would find it taken.
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            await self._engine.wake(("weights",))
        if not self._current:
            await self._engine.update_weights(hf_named(parallel.full_parameters(self._model)))
            self._current = True
        if self._asleep:
            await self._engine.wake(("kv_cache",))
            self._asleep = False


@dataclass(eq=False)
class Run:
    """One training run's parts. `state` is where the run stands (phase, step), advanced by the
    phases; `optimizer` is replaced when RL starts with moments of its own."""

    cfg: Config
    world: parallel.World
    device: torch.device
    folder: RunFolder
    env: Env
    tasks: TaskSets
    tokenizer: Tokenizer
    tokenizer_dir: Path | None
    model: Transformer
    optimizer: torch.optim.Optimizer
    state: checkpointing.TrainerState
    resume_from: Path | None
    engine: Engine
    sync: EngineSync
    runlog: RunLog

    async def evaluate(self, phase: str, step: int) -> None:
        """The held-out tasks on the current policy: their roots dealt over every rank's engine
        (`rollout.dealing`, as a step's are), the groups gathered and reported by rank 0."""
        if not self.tasks.held_out:
            return
        watchdog.phase(f"evaluation {phase} at step {step}")
        await self.sync()
        began = time.perf_counter()
        tasks = evaluated_tasks(self.cfg, self.tasks.held_out)
        per_task = trees_per_task(self.cfg, phase)
        shares = dealing.deal(len(tasks), per_task, self.world.size)
        mine = shares[self.world.rank]
        rolled = (
            await roll_out(
                self.cfg,
                self.tokenizer,
                self.env,
                [tasks[task] for task, _ in mine],
                self.engine,
                per_task=per_task,
                samples=[samples for _, samples in mine],
            )
            if mine
            else []
        )
        parts = [(task, group) for (task, _), group in zip(mine, rolled, strict=True)]
        everyone = parallel.gather_to_main(parts)
        if everyone is not None:
            groups = dealing.merge(tasks, range(len(tasks)), everyone)
            figures = await report(
                self.cfg,
                self.env,
                tasks,
                groups,
                seconds=time.perf_counter() - began,
                per_task=per_task,
            )
            figures = {"phase": phase, "step": step, **figures}
            self.runlog.eval(figures)
            log.info(
                "eval %-5s step %3d  reward %s  spawn rate %s  children/root %.2f  "
                "(%d tasks, %s, %.0f s)",
                phase,
                step,
                _number(figures["reward_mean"]),
                _percent(figures["spawn_rate"]),
                figures["children_per_root"],
                figures["tasks"],
                _engines(sum(1 for share in shares if share)),
                figures["seconds"],
            )
            failure = failed_everywhere(groups)
            if failure:  # the run goes on (a final one stopped here would lose the export)
                log.warning(
                    "eval %s: no tree could run, no figure is the policy's: %s", phase, failure
                )
        parallel.barrier()

    async def evaluate_once(self, phase: str, step: int) -> None:
        """`evaluate`, unless the run has this phase's evaluation on record (a resumed run).
        Rank 0 keeps the records; every rank must agree, as evaluation ends at a barrier."""
        if not parallel.broadcast(self.runlog.evaluated(phase, step)):
            await self.evaluate(phase, step)

    def checkpoint(
        self, phase: str, step: int, lr: float, reference: Transformer | None = None
    ) -> None:
        watchdog.phase(f"saving checkpoint {phase} {step}")
        done = msgspec.structs.replace(self.state, phase=phase, step=step, lr=lr)
        frozen = {"reference": reference} if reference is not None else None
        out = checkpointing.save(
            self.folder.root,
            self.model,
            self.optimizer,
            done,
            keep=self.cfg.checkpoint.keep,
            frozen=frozen,
        )
        log.info("checkpoint %s", out)

    def due(self, step: int, steps: int) -> bool:
        """Whether step `step` of a phase of `steps` ends in a checkpoint: every N, and the
        phase's last, so a run killed after a phase never has to do any of it again."""
        every = self.cfg.checkpoint.every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == steps)

    def export(self) -> Path:
        """The model as a Hugging Face checkpoint in `model.dtype`, with the tokenizer files it
        was trained with: gathered from the shards a parameter at a time onto rank 0's CPU,
        written by rank 0."""
        watchdog.phase("export")
        return export(self.model, self.cfg, self.tokenizer, self.tokenizer_dir, self.folder.final)

    async def close(self) -> None:
        self.runlog.close()
        await self.engine.close()


def export(
    model: Transformer,
    cfg: Config,
    tokenizer: Tokenizer,
    tokenizer_dir: Path | None,
    out: Path,
) -> Path:
    """`model` (sharded or not) written to `out` as `Run.export` does."""
    state = parallel.whole_on_main(model, DTYPES[cfg.model.dtype])
    if state is not None:
        files = tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
        generation = None
        if not any(f.name == "generation_config.json" for f in files):
            generation = {"eos_token_id": list(tokenizer.stop_ids)}
        save_hf(
            model,
            out,
            state=state,
            dtype=DTYPES[cfg.model.dtype],
            generation=generation,
            extra_files=files,
        )
    parallel.barrier()
    return out


def max_over_ranks(row: dict[str, Any], *keys: str) -> None:
    """Sets each of `row`'s `keys` to its largest value on any rank, and adds `progress_gap_s`:
    the longest any rank worked in the step without marking progress, the margin under
    `parallel.stall_timeout_s` (absent when the run is not watched). One all_max for them all;
    a collective: every rank calls it."""
    names = list(keys)
    values = [float(row[key]) for key in keys]
    gap = watchdog.longest_unmarked()
    if gap is not None:
        names.append("progress_gap_s")
        values.append(gap)
    if names:
        maxima = parallel.all_max(torch.tensor(values, dtype=torch.float64))
        row.update(zip(names, maxima.tolist(), strict=True))


def mean_or_nan(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _engines(count: int) -> str:
    return "1 engine" if count == 1 else f"{count} engines"


def _number(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"


def _percent(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.0%}"
