"""Training on several ranks, for real: torchrun, gloo, FSDP2 over two CPU processes.

- the trainer's GRPO step on fixed rollouts gives the same master weights on two FSDP2 ranks
  (holding unequal numbers of samples) as in one process, with and without activation
  checkpointing, compiled layers and a sharded KL reference (`tests/distributed_steps.py` does
  the steps), and
  each rank's own engine, synced one gathered parameter at a time, then holds those weights;
- bf16 compute keeps fp32 master weights, which a 1e-6 learning rate still moves;
- the Hugging Face export, gathered from the shards, loads in transformers with our logits;
- `torchrun --nproc_per_node 2 -m rlmtrain train` and `python -m rlmtrain train` run the
  shortened default to the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clocks import RUN_HANG_S
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "tests" / "distributed_steps.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env() -> dict[str, str]:
    # Each rank gets one thread, as torchrun would give it; the machine has two cores.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _launched(command: list[str]) -> subprocess.CompletedProcess:
    """`command` run to its end (one thread a rank); it must succeed."""
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _torchrun(ranks: int, port: int) -> list[str]:
    return [
        *TORCHRUN,
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(port + os.getpid() % 1000),
    ]


def _steps(out: Path, *args: str, ranks: int = 1) -> dict:
    launch = _torchrun(ranks, 29500) if ranks > 1 else [sys.executable]
    result = _launched([*launch, str(STEPS), str(out), *args])
    return json.loads(result.stdout.strip().splitlines()[-1])


def _max_diff(a: Path, b: Path) -> float:
    left, right = torch.load(a), torch.load(b)
    assert left.keys() == right.keys()
    return max((left[k] - right[k]).abs().max().item() for k in left)


# Adam divides each gradient by its own running scale, so where a gradient is as small as eps a
# difference in its last bits (the two runs sum the micro-batches in another order) moves the
# weight by a fraction of the LR. eps = 1e-6 keeps that below the comparison's 1e-5.
COMMON = ("--steps", "3", "--lr", "1e-4", "--adam-eps", "1e-6")


@pytest.mark.parametrize(
    "variant",
    [
        (),
        ("--activation-checkpointing", "--kl-beta", "0.05"),
        ("--compile-layers", "--kl-beta", "0.05"),
    ],
    ids=["plain", "checkpointing+kl", "compiled+kl"],
)
def test_two_fsdp2_ranks_compute_the_update_of_one_process(tmp_path, variant):
    """The one process runs eager layers: the compiled ones (policy, KL reference) under FSDP2's
    hooks must compute its update."""
    kl = tuple(a for a in variant if a not in ("--activation-checkpointing", "--compile-layers"))
    alone = _steps(tmp_path / "one.pt", *COMMON, *kl)
    pair = _steps(tmp_path / "two.pt", *COMMON, *variant, ranks=2)
    assert alone["samples_per_rank"] == [9]
    assert sorted(pair["samples_per_rank"]) == [4, 5]  # unequal shares of the batch
    assert pair["losses"] == pytest.approx(alone["losses"], abs=1e-6)
    assert pair["dtypes"] == ["torch.float32"]
    assert _max_diff(tmp_path / "one.pt", tmp_path / "two.pt") <= 1e-5
    assert alone["changed_fraction"] > 0.99  # the steps did move the weights
    # Each rank's engine, synced from the shards, holds every weight bit for bit.
    assert alone["engine_misses"] == [[]]
    assert pair["engine_misses"] == [[], []]
    assert alone["compiled_graphs"] == 0
    assert (pair["compiled_graphs"] > 0) is ("--compile-layers" in variant)


def test_adamw_moments_in_host_memory_take_the_same_steps_on_two_ranks(tmp_path):
    """`train.optimizer_offload` over FSDP2 shards: the moments are DTensors of the shards'
    layout in host memory, stepped a parameter at a time, and the weights come out bit for bit
    those of torch's AdamW."""
    plain = _steps(tmp_path / "plain.pt", *COMMON, ranks=2)
    offloaded = _steps(tmp_path / "offload.pt", *COMMON, "--optimizer-offload", ranks=2)
    assert (plain["optimizer"], offloaded["optimizer"]) == ("AdamW", "HostAdamW")
    assert offloaded["losses"] == plain["losses"]
    assert _max_diff(tmp_path / "plain.pt", tmp_path / "offload.pt") == 0.0
    assert offloaded["changed_fraction"] > 0.99


def test_hsdp_over_two_replicas_computes_the_update_of_fsdp_over_four_ranks(tmp_path):
    """`parallel.replicate = 2` on 4 ranks: two copies of the model, each sharded over 2 ranks,
    gradients summed across the copies; the same update as one model sharded over all 4."""
    args = (*COMMON, "--kl-beta", "0.05")
    flat = _steps(tmp_path / "fsdp.pt", *args, ranks=4)
    hybrid = _steps(tmp_path / "hsdp.pt", *args, "--replicate", "2", ranks=4)
    assert flat["mesh"] == [4]
    assert hybrid["mesh"] == [2, 2]
    assert hybrid["losses"] == pytest.approx(flat["losses"], abs=1e-6)
    assert _max_diff(tmp_path / "fsdp.pt", tmp_path / "hsdp.pt") <= 1e-5
    assert hybrid["changed_fraction"] > 0.99
    assert hybrid["engine_misses"] == [[], [], [], []]


def test_bf16_compute_moves_every_fp32_master_weight(tmp_path):
    """At lr 1e-6, bf16 weights would round most updates away (a bf16 ulp near 0.02 is 1.2e-4);
    the fp32 masters take them."""
    summary = _steps(tmp_path / "bf16.pt", "--steps", "2", "--lr", "1e-6", "--dtype", "bfloat16")
    assert summary["dtypes"] == ["torch.float32"]
    assert summary["changed_fraction"] >= 0.99


def test_bf16_export_of_sharded_masters_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    import msgspec

    from rlmtrain import parallel
    from rlmtrain.config import Config, ModelConfig
    from rlmtrain.model import build_model, load_hf
    from rlmtrain.model.tokenizer import load_tokenizer
    from rlmtrain.training.run import export

    cfg = Config()
    cfg = msgspec.structs.replace(
        cfg, model=ModelConfig(preset="tiny", vocab_size=300, dtype="bfloat16", seed=3)
    )
    world, device = parallel.start("cpu")
    try:
        model = parallel.shard(build_model(ModelConfig(preset="tiny", vocab_size=300, seed=3)),
                               device, torch.bfloat16)  # fmt: skip
        tokenizer = load_tokenizer("byte")
        out = export(model, cfg, tokenizer, None, tmp_path / "final")
    finally:
        parallel.stop()
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(tokenizer.stop_ids)
    assert not list(tmp_path.glob(".*partial"))

    ours = load_hf(out, dtype=torch.bfloat16, attention="sdpa").eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = ours(ids[0], torch.arange(40), torch.tensor([0, 40]))
        logits = (hidden @ ours.lm_head_weight.T).float()
        reference = theirs(ids).logits[0].float()
    assert theirs.dtype == torch.bfloat16
    # Both in bf16 from the same bf16 weights; their kernels round differently in the last bit.
    assert (logits - reference).abs().max().item() <= 0.05 * reference.abs().max().item()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.95


SHORT = (
    "--config",
    "configs/tiny-cpu.toml",
    "--data.sft_groups=3",
    "--data.synth_groups=2",
    "--data.eval_groups=1",
    "--train.sft_steps=4",
    "--train.steps=2",
    "--train.tasks_per_step=2",
    "--rollout.n_samples=2",
    "--rollout.max_new_tokens=48",
    "--eval.every=1",
    "--eval.tasks=1",
    "--eval.init_samples=2",  # two roots at init too, one for each rank's engine
    "--logging.progress=false",
    "--checkpoint.every=2",
)


@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_launched_training_runs_to_the_end(tmp_path, launch):
    head = [sys.executable] if launch == "python" else _torchrun(2, 29600)
    # Two ranks and one task a step: its roots are dealt, so both engines roll out.
    dealt = () if launch == "python" else ("--train.tasks_per_step=1",)
    run_dir = tmp_path / "run"
    result = _launched(
        [*head, "-m", "rlmtrain", "train", *SHORT, *dealt, f"--checkpoint.dir={run_dir}"]
    )
    ranks = 1 if launch == "python" else 2
    assert f"on {ranks} x cpu" in result.stderr
    phases = [json.loads(line)["phase"] for line in (run_dir / "eval.jsonl").open()]
    assert phases == ["init", "sft", "rl", "final"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [(r["phase"], r["step"]) for r in steps] == [
        *(("sft", k) for k in range(4)),
        *(("rl", k) for k in range(2)),
    ]
    for row in steps:  # the watched run's margin under parallel.stall_timeout_s, every step
        assert 0 <= row["progress_gap_s"] < 600, row
    for row in steps[4:]:
        # The slowest rank's rollout: it may have begun before rank 0's step did, so it is not
        # bounded by rank 0's `seconds`.
        assert row["rollout_s"] > 0, row
        assert len(row["generated_tokens_per_rank"]) == ranks
        assert min(row["generated_tokens_per_rank"]) > 0, row  # no engine idled
        # The synchronous loop trains every token under the weights that sampled it.
        assert row["staleness_max"] == 0 and row["staleness_fresh_frac"] == 1.0, row
        trained = ("train", "sync") if "loss" in row else ()  # a step may keep no group
        for mark in ("rollout", *trained):  # each rank's memory at each phase
            assert len(row["memory_gib_ranks"][f"{mark}_resident"]) == ranks
            assert row["memory_gib"][f"{mark}_resident"] > 0.1
    engines = "1 engine" if ranks == 1 else f"{ranks} engines"
    assert result.stderr.count(f"tasks, {engines},") == 4  # each evaluation, dealt too
    assert (run_dir / "final" / "model.safetensors").is_file()
    newest = run_dir / "checkpoints" / "rl-000002"
    assert sorted(p.name for p in newest.glob("rng-*.pkl")) == [
        f"rng-{r}.pkl" for r in range(ranks)
    ]


FAILING = ROOT / "tests" / "failing_repl_train.py"


@pytest.mark.parametrize("failing", ["1", "0,1"])
def test_an_rl_step_stops_where_no_rank_s_tree_could_run(tmp_path, failing):
    """Trees fail on rank 1 alone: the step trains rank 0's groups, its row counts the failed
    roots, the run ends. On both ranks: every rank stops at step 0 with the cause, none waits
    in a collective for another."""
    run_dir = tmp_path / "run"
    overrides = ["--train.sft_steps=0", "--train.steps=1"]
    result = subprocess.run(
        [*_torchrun(2, 29700), str(FAILING), failing, "train", *SHORT, *overrides,
         f"--checkpoint.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_HANG_S, env=_env(),
    )  # fmt: skip
    if failing == "1":
        assert result.returncode == 0, result.stderr[-3000:]
        (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        assert row["generated_tokens_per_rank"][1] == 0 < row["generated_tokens_per_rank"][0]
        assert row["roots_failed"] == 2 and row["groups_kept"] + row["groups_dropped_uniform"] == 1
        return
    assert result.returncode != 0
    stops = [line for line in result.stderr.splitlines() if "error: rl step 0" in line]
    assert len(stops) == 2, result.stderr[-3000:]  # one line from each rank
    for line in stops:
        assert "no tree could run (each of its 4 roots failed in the scheduler)" in line, line
        assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in line, line


START = ROOT / "tests" / "distributed_start.py"


def _qwen3_06b_checkpoint(directory: Path) -> None:
    """A Qwen3-0.6B-shaped bf16 checkpoint (as published checkpoints are stored) of random
    weights, written without ever holding the model in fp32."""
    from rlmtrain.config import ModelConfig
    from rlmtrain.model import model_skeleton, save_hf

    skeleton = model_skeleton(ModelConfig(preset="qwen3-0.6b"))
    generator = torch.Generator().manual_seed(0)
    state = {
        name: torch.empty(p.shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
        for name, p in skeleton.named_parameters()
    }
    save_hf(skeleton, directory, state=state)


def test_two_ranks_start_and_export_a_qwen3_06b_holding_only_their_shards(tmp_path):
    """Each rank builds the policy on the meta device, shards it, and reads only its own rows
    of every tensor from the files: its memory grows by its fp32 shards (half the model) and a
    little, never by the whole fp32 model (which building it first and sharding it after cost
    every rank, 2.4 GB here). The export gathers one parameter at a time onto rank 0, which
    writes it; rank 1 holds its shards and one whole parameter, and the checkpoint written is
    the one read, bit for bit (bf16 in, fp32 masters, bf16 out)."""
    _qwen3_06b_checkpoint(tmp_path / "ckpt")
    result = _launched(
        [*_torchrun(2, 29700), str(START), str(tmp_path / "ckpt"), str(tmp_path / "out")]
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    whole, largest = figures["whole_fp32_bytes"], figures["largest"]
    assert whole > 2.3e9  # the real shape: 596M parameters
    for rank in figures["ranks"]:
        assert rank["shard"] == pytest.approx(whole / 2, rel=0.01)
        assert rank["start"] <= 0.65 * whole, (rank, whole)
    other = figures["ranks"][1]
    assert other["export"] <= other["shard"] + 1.1 * largest + 64 * 2**20, (other, largest)
    written = load_file(tmp_path / "out" / "model.safetensors")
    read = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert written.keys() == read.keys()
    assert all(torch.equal(written[name], read[name]) for name in read)
