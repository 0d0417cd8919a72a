"""The training script end to end, as a user runs it: a real subprocess on a small code base.

SFT on the codenav teacher's trees must lower the loss on the task it sees every step; GRPO
steps must roll out through the scheduler and native engine (with KL, exploration bonus and
tool credit on); periodic and final checkpoints must load back.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
            "rlmtrain.cli",
            "train",
            "--config",
            "configs/tiny-cpu.toml",
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=600,
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
        "--rollout.max_new_tokens=24",
        "--checkpoint.every=2",
        "--algo.kl_beta=0.01",
        "--algo.exploration_beta=0.1",
        "--algo.tool_credit_alpha=0.5",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in rows if r["phase"] == "sft"]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(sft) == 4 and len(rl) == 2
    assert sft[-1]["loss"] < sft[0]["loss"], [r["loss"] for r in sft]
    assert sum(rl[0]["finish_reasons"].values()) >= 2  # G = 2 roots at least
    assert rl[0]["generated_tokens"] > 0
    saved = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name != "data")
    assert saved == ["final", "rl-step2", "sft-step2", "sft-step4"]
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
    """One `_grpo_step` on a hand-made group: the loss is finite, the KL to the frozen reference
    starts at 0, the engine log-probs equal pi_old, and the better root's tokens gain log-prob."""
    import msgspec
    import torch
    from rlmtrain.kernels import fused_linear_logprob

    from rlmtrain import train
    from rlmtrain.algo import build_samples, compute_advantages, pack
    from rlmtrain.config import Config, ModelConfig
    from rlmtrain.model import build_model
    from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn

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
    advantages, _ = compute_advantages([group], [[1.0, 0.0]], cfg.algo)
    batches = pack(build_samples([group], advantages, cfg.algo), cfg.algo.micro_batch_tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = train._frozen_copy(model)
    before = sum(engine_logprobs(completions[0]))
    row = train._grpo_step(model, optimizer, batches, cfg, torch.device("cpu"), reference)
    assert torch.isfinite(torch.tensor(row["loss"]))
    assert row["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert row["engine_logp_max_abs_diff"] < 1e-4
    assert row["grad_norm"] > 0
    assert sum(engine_logprobs(completions[0])) > before
