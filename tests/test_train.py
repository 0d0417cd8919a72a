"""The training script end to end, as a user runs it: a real subprocess on a small code base.

SFT on the codenav teacher's trees must lower the loss on the task it sees every step; GRPO
steps must roll out through the scheduler and native engine (with KL, exploration bonus, tool
credit and heuristic step rubrics on, each turn's rubric logged per criterion); periodic
resumable checkpoints are kept and the final export loads back.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from clocks import RUN_HANG_S

from rlmtrain.envs.base import write_tasks
from rlmtrain.envs.codenav import generate_tasks
from rlmtrain.model import load_hf

PACKAGE = {
    "shop/__init__.py": "",
    "shop/cart.py": """
        from shop.prices import price_of


        def total(items):
            return sum(price_of(item) for item in items)
    """,
    "shop/prices.py": """
        def price_of(item):
            return round(item * 1.2, 2)
    """,
}


def run_train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmtrain",
            "train",
            "--config",
            "configs/tiny-cpu.toml",
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=RUN_HANG_S,
    )


@pytest.fixture
def codenav_tasks(tmp_path) -> Path:
    for name, source in PACKAGE.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    tasks = generate_tasks(tmp_path / "shop", n=1, seed=0)
    assert tasks, "the test package must yield a codenav task"
    out = tmp_path / "tasks.jsonl"
    write_tasks(out, tasks)
    return out


@pytest.mark.slow
def test_sft_then_grpo_end_to_end(tmp_path, codenav_tasks):
    run_dir = tmp_path / "run"
    result = run_train(
        "--data.env=codenav",
        f"--data.train_path={codenav_tasks}",
        f"--checkpoint.dir={run_dir}",
        "--train.sft_steps=4",
        "--train.steps=2",
        "--train.lr=3e-3",
        "--rollout.max_turns=3",
        "--rollout.max_new_tokens=200",  # the teacher's turns run under the same limit
        "--checkpoint.every=2",
        "--algo.kl_beta=0.01",
        "--algo.exploration_beta=0.1",
        "--algo.tool_credit_alpha=0.5",
        "--algo.step_rewards=heuristic",
        "--model.tokenizer=byte",
        "--rollout.prompt_style=full",
        "--rollout.max_prompt_tokens=12288",
        "--algo.micro_batch_tokens=12544",  # holds the longest turn the limits allow
        "--eval.every=0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in rows if r["phase"] == "sft"]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(sft) == 4 and len(rl) == 2
    assert sft[-1]["loss"] < sft[0]["loss"], [r["loss"] for r in sft]
    assert sum(rl[0]["finish_reasons"].values()) >= 2  # G = 2 roots at least
    assert rl[0]["generated_tokens"] > 0
    for row in rl:
        assert all(0 <= row[f"step_{c}"] <= 1 for c in ("relevance", "info_gain", "coherence"))
        assert -0.05 <= row["step_reward"] <= 0.95, row["step_reward"]  # weights sum to 1, cost
    saved = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name not in ("data", "tb"))
    assert saved == ["checkpoints", "final"]
    # Resumable checkpoints every 2 steps of each phase, the newest checkpoint.keep = 2 kept.
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["rl-000002", "sft-000004"]
    model = load_hf(run_dir / "final")
    assert model.args.vocab_size == 384


def test_missing_task_file_is_a_one_line_error(tmp_path):
    result = run_train("--data.env=codenav", f"--data.train_path={tmp_path / 'none.jsonl'}")
    assert result.returncode == 2
    assert "data.train_path" in result.stderr and "none.jsonl" in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_task_line_is_a_one_line_error(tmp_path, codenav_tasks):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(codenav_tasks.read_text() + '{"id": "x", "query": 3}\n')
    result = run_train("--data.env=codenav", f"--data.train_path={bad}", "--train.sft_steps=0")
    assert result.returncode == 2
    assert "bad.jsonl" in result.stderr and ":2" in result.stderr
    assert "Traceback" not in result.stderr


def test_grpo_step_moves_the_policy_with_kl_and_tis():
    """One `grpo_step` on a hand-made group: the loss is finite, the KL to the frozen reference
    starts at 0, the engine log-probs equal pi_old, and the better root's tokens gain log-prob."""
    import msgspec
    import torch

    from rlmtrain.algo import build_samples, compute_advantages, pack
    from rlmtrain.config import Config, ModelConfig
    from rlmtrain.kernels import fused_linear_logprob
    from rlmtrain.model import build_model
    from rlmtrain.rewards.step_rewards import StepRewards
    from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn
    from rlmtrain.training.steps import grpo_step

    torch.manual_seed(0)
    model = build_model(ModelConfig())
    prompt = list(b"<|im_start|>user\nsay hi<|im_end|>\n")
    completions = [list(b"hi there"), list(b"go away!")]

    def engine_logprobs(ids: list[int]) -> list[float]:
        full = torch.tensor(prompt + ids)
        with torch.no_grad():
            hidden = model(full[:-1], torch.arange(len(full) - 1), torch.tensor([0, len(full) - 1]))
            logp = fused_linear_logprob(hidden, model.lm_head_weight, full[1:])
        return logp[len(prompt) - 1 :].tolist()

    roots = [
        Trajectory(
            id=f"t#{g}", root_id=f"t#{g}", parent_id=None, depth=0, task_id="t", sample_idx=g,
            prompt="say hi", finish_reason="final", answer=bytes(ids).decode(),
            turns=[
                Turn(prompt_ids=prompt, completion_ids=ids, sampler_logprobs=engine_logprobs(ids))
            ],
        )
        for g, ids in enumerate(completions)
    ]  # fmt: skip
    group = RolloutGroup(task={"id": "t"}, trajectories=roots)
    cfg = Config()
    cfg = msgspec.structs.replace(cfg, algo=msgspec.structs.replace(cfg.algo, kl_beta=0.05))
    advantages, _ = compute_advantages([group], StepRewards(roots=[[1.0, 0.0]]), cfg.algo)
    batches = pack(build_samples([group], advantages, cfg.algo), cfg.algo.micro_batch_tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = _frozen_copy(model)
    before = sum(engine_logprobs(completions[0]))
    row = grpo_step(model, optimizer, batches, cfg, torch.device("cpu"), reference)
    assert torch.isfinite(torch.tensor(row["loss"]))
    assert row["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert row["tis_clipped_frac"] == 0.0  # the engine's log-probs equal the trainer's
    assert row["tis_ess_frac"] == pytest.approx(1.0, abs=1e-5)  # and so every weight is ~1
    assert row["grad_norm"] > 0
    assert sum(engine_logprobs(completions[0])) > before


def _frozen_copy(model):
    """The KL reference of an unsharded model, as the trainer makes it of a sharded one."""
    import copy

    return copy.deepcopy(model).eval().requires_grad_(False)


def _hand_made_batches(model, cfg, n_roots: int = 4):
    """A group of `n_roots` one-turn roots with engine log-probs of `model`, packed in
    micro-batches of one sample each."""
    import torch

    from rlmtrain.algo import build_samples, compute_advantages, pack
    from rlmtrain.kernels import fused_linear_logprob
    from rlmtrain.rewards.step_rewards import StepRewards
    from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn

    prompt = list(b"<|im_start|>user\nsay hi<|im_end|>\n")
    roots = []
    for g in range(n_roots):
        ids = list(f"reply number {g}".encode())
        full = torch.tensor(prompt + ids)
        with torch.no_grad():
            hidden = model(full[:-1], torch.arange(len(full) - 1), torch.tensor([0, len(full) - 1]))
            logp = fused_linear_logprob(hidden, model.lm_head_weight, full[1:])
        turn = Turn(
            prompt_ids=prompt, completion_ids=ids, sampler_logprobs=logp[len(prompt) - 1 :].tolist()
        )
        roots.append(
            Trajectory(
                id=f"t#{g}", root_id=f"t#{g}", parent_id=None, depth=0, task_id="t",
                sample_idx=g, prompt="say hi", finish_reason="final", answer="x", turns=[turn],
            )
        )  # fmt: skip
    group = RolloutGroup(task={"id": "t"}, trajectories=roots)
    advantages, _ = compute_advantages(
        [group], StepRewards(roots=[[float(g) for g in range(n_roots)]]), cfg.algo
    )
    return pack(build_samples([group], advantages, cfg.algo), len(prompt) + 20)


@pytest.mark.parametrize("updates", [1, 2])
def test_grpo_step_forwards(updates, monkeypatch):
    """One update per batch runs one forward per micro-batch (pi_old is the detached policy,
    `old_logp=None`); two updates compute pi_old once first (a no-grad forward per micro-batch)
    and then step twice."""
    import msgspec
    import torch

    from rlmtrain.config import Config, ModelConfig
    from rlmtrain.model import Transformer, build_model
    from rlmtrain.training.steps import grpo_step

    torch.manual_seed(0)
    model = build_model(ModelConfig())
    cfg = Config()
    cfg = msgspec.structs.replace(
        cfg, algo=msgspec.structs.replace(cfg.algo, updates_per_batch=updates)
    )
    batches = _hand_made_batches(model, cfg)
    micro = sum(1 for mb in batches.micro_batches() if mb.num_tokens)
    assert micro == 4
    forwards = []
    original = Transformer.forward
    monkeypatch.setattr(
        Transformer,
        "forward",
        lambda self, *args, **kw: (
            forwards.append(torch.is_grad_enabled()) or original(self, *args, **kw)
        ),
    )
    steps = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monkeypatch.setattr(optimizer, "step", lambda *a, **k: steps.append(1))
    row = grpo_step(model, optimizer, batches, cfg, torch.device("cpu"))
    if updates == 1:
        assert forwards == [True] * micro and len(steps) == 1
    else:
        assert forwards == [False] * micro + [True] * micro and len(steps) == 2
        assert row["engine_logp_max_abs_diff"] < 1e-4
    assert row["updates"] == updates


@pytest.mark.parametrize("updates", [1, 2])
def test_grpo_step_fused_and_unfused_agree(updates):
    """The GRPO step through the fused loss's torch backend and through full logits: the same
    loss, metrics and updates (fp32), with KL, TIS and PPO-style updates on."""
    import copy

    import msgspec
    import torch

    from rlmtrain.config import Config, ModelConfig
    from rlmtrain.model import build_model
    from rlmtrain.training.steps import grpo_step

    torch.manual_seed(0)
    model = build_model(ModelConfig())
    cfg = Config()
    algo = msgspec.structs.replace(cfg.algo, kl_beta=0.05, updates_per_batch=updates)
    rows, models = {}, {}
    for impl in ("torch", "unfused"):
        run = copy.deepcopy(model)
        impl_cfg = msgspec.structs.replace(
            cfg, algo=algo, train=msgspec.structs.replace(cfg.train, loss_impl=impl)
        )
        batches = _hand_made_batches(run, impl_cfg)
        # SGD: the weights move by lr * gradient, so they compare the gradients themselves
        # (Adam's first step is the gradient's sign, which flips on gradients near 0).
        optimizer = torch.optim.SGD(run.parameters(), lr=1.0)
        reference = _frozen_copy(model)
        rows[impl] = grpo_step(run, optimizer, batches, impl_cfg, torch.device("cpu"), reference)
        models[impl] = run
    for key in ("loss", "kl_mean", "clip_frac_low", "clip_frac_high", "entropy", "grad_norm"):
        assert rows["unfused"][key] == pytest.approx(rows["torch"][key], abs=1e-5), key
    for (name, a), b in zip(
        models["torch"].named_parameters(), models["unfused"].parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


class _SleepyEngine:
    """Records what the weight sync asks of a colocated engine, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    async def wake(self, tags) -> None:
        self.calls.append(f"wake {'+'.join(tags)}")

    async def update_weights(self, named_tensors) -> None:
        self.calls.append(f"update {len(list(named_tensors))}")


@pytest.mark.parametrize("colocate", [False, True])
def test_colocated_sync_sleeps_for_the_step_and_wakes_weights_before_the_kv_cache(colocate):
    import asyncio

    from rlmtrain.config import ModelConfig
    from rlmtrain.model import build_model
    from rlmtrain.training.run import EngineSync

    model = build_model(ModelConfig(preset="tiny", vocab_size=300))
    engine = _SleepyEngine()
    sync = EngineSync(engine, model, colocate=colocate)
    every = f"update {len(list(model.parameters()))}"

    async def a_run():
        await sync()  # before the first rollout
        await sync()  # nothing changed: nothing sent
        for _ in range(2):  # two steps: train, then sync for the next rollout
            await sync.release()
            sync.stale()
            await sync()

    asyncio.run(a_run())
    step = ["sleep 2", "wake weights", every, "wake kv_cache"] if colocate else [every]
    assert engine.calls == [every, *step, *step]
