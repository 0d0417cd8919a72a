"""The training script end to end, as a user runs it: a real subprocess on a small code base.

SFT on the codenav teacher's trees must lower the loss on the task it sees every step; one GRPO
step must roll out through the scheduler and native engine; the checkpoint must load back.
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
        "--train.steps=1",
        "--train.lr=3e-3",
        "--rollout.max_turns=3",
        "--rollout.max_new_tokens=24",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in rows if r["phase"] == "sft"]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(sft) == 4 and len(rl) == 1
    assert sft[-1]["loss"] < sft[0]["loss"], [r["loss"] for r in sft]
    assert sum(rl[0]["finish_reasons"].values()) >= 2  # G = 2 roots at least
    assert rl[0]["generated_tokens"] > 0
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
