"""The trainer's whole RL step on one device, measured by running the trainer itself: rollout,
scoring, the fused GRPO loss with AdamW, the weight sync, and each phase's seconds.

What runs is `rlmtrain train` (`cli.main`, in this process, so that its memory counters can be
read after it) on `configs/tiny-cpu.toml` with overrides: the `--preset` shape with random
weights, no SFT, no evaluation, no checkpoints, the native engine (continuous batching, paged
KV cache with prefix caching), the evidence env's synthetic tasks with the jailed REPL, the
heuristic step rubric, a trained BPE (the model keeps the preset's vocabulary, so its LM head is
the real one), bf16 compute with fp32 masters on CUDA. Then the run's export (not timed).

The weights are random, so the policy writes noise: nearly every turn runs to `--new-tokens`,
hardly any holds code for the REPL (the count is printed) and every reward is equal. Groups of
equal rewards are kept (`algo.drop_uniform_groups=false`), else such a step would train nothing.
The timings are those of the machinery at these lengths, not of a trained policy's trees.

Figures, per step from the run's metrics.jsonl (`training/rl.py`'s row): rollout_s, train_s
(packing, the GRPO step, AdamW), sync_s (the new weights into the engine), the whole step's
seconds, the engine's generated tokens/s, generated tokens, tokens laid out in micro-batches and
their rate through the train step. Trained tokens: the row does not carry them (`grpo_step` uses
its count for the entropy's mean and drops it), so the figure is the generated tokens, which with
every group kept are exactly the trained targets. Step 0 compiles kernels and is left out of the
means when there are more steps (a later one may still recompile flex attention for a new packed
length: the per-step rows show it). Memory: on CUDA torch's peak allocated and reserved bytes read
after the run (the trainer and the native engine share this process), against the card; where
the rows carry `memory_gib` (each phase's peaks, read by resetting torch's counters, so that the
peaks read after the run then cover only the last phase and the export), those are printed too,
as row_*. On a CPU, the process's peak resident set.

    python3 bench/gpu/rl_step.py [--preset qwen3-0.6b] [--steps 3] [--out rl-step.json]
    python bench/gpu/rl_step.py --device cpu --preset tiny --steps 2     # checks that it runs

Other `--section.key=value` arguments go to the trainer as they are. On a CPU the rollout
defaults shrink (2 tasks x 2 samples x 2 turns x 32 tokens) so the check takes seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlmtrain import cli
from rlmtrain.memory import GIB, peak_resident_bytes
from rlmtrain.model import preset

ROOT = Path(__file__).resolve().parents[2]
BPE_VOCAB = 2048  # configs/tiny-cpu.toml's model.bpe_vocab_size
# tasks per step, samples per task, turns per trajectory, new tokens per turn
SIZES = {"cuda": (4, 8, 3, 128), "cpu": (2, 2, 2, 32)}


def rollout_sizes(options: argparse.Namespace) -> dict[str, int]:
    """--tasks, --samples, --turns, --new-tokens, each given or the device's default."""
    defaults = SIZES["cuda" if options.device.startswith("cuda") else "cpu"]
    names = ("tasks", "samples", "turns", "new_tokens")
    given = (getattr(options, name) for name in names)
    return {n: d if g is None else g for n, g, d in zip(names, given, defaults, strict=True)}


def trainer_arguments(
    options: argparse.Namespace, sizes: dict[str, int], run_dir: Path, overrides: list[str]
) -> list[str]:
    cuda = options.device.startswith("cuda")
    tasks, samples, turns, new_tokens = sizes.values()
    arguments = [
        "train",
        "--config",
        str(ROOT / "configs" / "tiny-cpu.toml"),
        f"--model.preset={options.preset}",
        "--model.tokenizer=bpe",
        f"--model.dtype={'bfloat16' if cuda else 'float32'}",
        f"--train.device={options.device}",
        "--train.sft_steps=0",
        f"--train.steps={options.steps}",
        f"--train.tasks_per_step={tasks}",
        f"--rollout.n_samples={samples}",
        f"--rollout.max_turns={turns}",
        f"--rollout.max_new_tokens={new_tokens}",
        "--rollout.engine=native",
        "--rollout.kv_cache_tokens=65536",
        "--algo.drop_uniform_groups=false",
        "--eval.every=0",
        "--data.sft_groups=1",
        "--data.synth_groups=2",
        f"--checkpoint.dir={run_dir}",
        "--checkpoint.every=0",
        "--checkpoint.resume=false",
        "--logging.progress=false",
        "--logging.tensorboard=false",
        "--logging.plot=false",
        f"--logging.sample_trees={tasks * samples}",
    ]
    vocab = preset(options.preset).vocab_size
    if vocab > BPE_VOCAB:  # else the BPE's own 2048 rows, as the tiny preset trains
        arguments.append(f"--model.vocab_size={vocab}")
    return arguments + overrides


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_figures(row: dict) -> dict:
    """One step's figures from its metrics.jsonl row (a step with no sample has no train phase)."""
    train_s, tokens = row.get("train_s", 0.0), row.get("tokens", 0)
    return {
        "step": row["step"],
        "rollout_s": row["rollout_s"],
        "train_s": train_s,
        "sync_s": row.get("sync_s", 0.0),
        "step_s": row["seconds"],
        "engine_tokens_per_s": row.get("engine_tokens_per_s", 0.0),
        "generated_tokens": row["generated_tokens"],
        "tokens": tokens,
        # The row has no count of trained tokens (module docstring): every generated one is.
        "trained_tokens": row.get("trained_tokens", row["generated_tokens"]),
        "train_tokens_per_s": tokens / train_s if train_s else 0.0,
    }


def repl_turns(trees: list[dict]) -> tuple[int, int]:
    """(turns whose code ran in the REPL, turns) over the logged trees of every step."""
    turns = [turn for tree in trees for t in tree["trajectories"] for turn in t["turns"]]
    return sum(1 for turn in turns if turn["code"]), len(turns)


def memory(device: str, rows: list[dict]) -> dict:
    if device.startswith("cuda"):
        _, total = torch.cuda.mem_get_info()
        figures = {
            "cuda_max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "cuda_max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "card_total_gib": total / GIB,
        }
    else:
        figures = {"peak_rss_gib": peak_resident_bytes() / GIB}
    for row in rows:  # each phase's peak over the timed steps, where the trainer writes them
        for key, value in row.get("memory_gib", {}).items():
            figures[f"row_{key}_gib"] = max(value, figures.get(f"row_{key}_gib", 0.0))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks", type=int, help="tasks per step (cuda 4, cpu 2)")
    parser.add_argument("--samples", type=int, help="trees per task (cuda 8, cpu 2)")
    parser.add_argument("--turns", type=int, help="turns per trajectory (cuda 3, cpu 2)")
    parser.add_argument("--new-tokens", type=int, help="tokens per turn (cuda 128, cpu 32)")
    parser.add_argument("--out", type=Path, help="also write the summary here as JSON")
    options, overrides = parser.parse_known_args()
    sizes = rollout_sizes(options)

    with tempfile.TemporaryDirectory(prefix="rl-step-") as scratch:
        run_dir = Path(scratch) / "run"
        arguments = trainer_arguments(options, sizes, run_dir, overrides)
        began = time.perf_counter()
        code = cli.main(arguments)  # 143 when stopped by SIGTERM, with the steps done on record
        wall = time.perf_counter() - began
        rows = [r for r in read_lines(run_dir / "metrics.jsonl") if r.get("phase") == "rl"]
        with_code, turns = repl_turns(read_lines(run_dir / "samples.jsonl"))

    timed_rows = rows[1:] if len(rows) > 1 else rows  # step 0 compiles
    steps = [step_figures(row) for row in rows]
    timed = [step_figures(row) for row in timed_rows]
    means = {key: statistics.fmean(s[key] for s in timed) for key in timed[0]} if timed else {}
    means.pop("step", None)
    summary = {
        "bench": "rl_step",
        "preset": options.preset,
        "device": torch.cuda.get_device_name() if options.device.startswith("cuda") else "cpu",
        **sizes,
        "exit_code": code,
        "wall_s": wall,
        "steps_done": len(steps),
        "timed_steps": [s["step"] for s in timed],
        **means,
        "repl_turns_with_code": with_code,
        "logged_turns": turns,
        **memory(options.device, timed_rows),
        "per_step": steps,
        "note": "random weights: turns run to the token limit and rarely hold code",
    }

    print(f"\nRL step, {options.preset} on {summary['device']}, random weights (noise, not code)")
    print(f"{'step':>4} {'rollout s':>9} {'train s':>8} {'sync s':>7} {'step s':>7} "
          f"{'engine tok/s':>12} {'generated':>9} {'laid out':>8} {'train tok/s':>11}")  # fmt: skip
    for s in steps:
        print(f"{s['step']:>4} {s['rollout_s']:>9.2f} {s['train_s']:>8.2f} {s['sync_s']:>7.3f} "
              f"{s['step_s']:>7.2f} {s['engine_tokens_per_s']:>12.0f} {s['generated_tokens']:>9} "
              f"{s['tokens']:>8} {s['train_tokens_per_s']:>11.0f}")  # fmt: skip
    for key, value in summary.items():
        if key != "per_step":
            print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    print(json.dumps(summary))
    if options.out:
        options.out.write_text(json.dumps(summary, indent=1) + "\n")
    return code if steps else max(code, 1)  # a run that did no step failed


if __name__ == "__main__":
    raise SystemExit(main())
