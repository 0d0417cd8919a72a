"""The rubric judge scored end to end by vLLM's own OpenAI-compatible server, on this machine.

The server is started as a user would (`python -m vllm.entrypoints.openai.api_server`) on a tiny
random model saved by `save_hf` with a BPE tokenizer and its chat template. A random model writes
noise, so every reply that scores does so because the server decoded to the JSON schema the
client sent (`judge.response_format = "json_schema"`): integers within 1-10, a bounded reason.
The server's whitespace is turned off (`disable_any_whitespace`): under a schema, a random model
would otherwise fill max_tokens with it. The same server then judges a codenav RL step's tool
credit and step rubric through the trainer (`algo.tool_credit = algo.step_rewards = "judge"`),
and `configs/booknav-cpu.toml`'s SFT filter, proof rewards and turn judges.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from clocks import RUN_HANG_S

from rlmtrain.config import JudgeConfig, ModelConfig
from rlmtrain.devices import HAS_VLLM
from rlmtrain.model import build_model, save_hf
from rlmtrain.model.bpe import tokenizer_files, train_bpe
from rlmtrain.rewards.judge import RubricJudge

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

START_TIMEOUT_S = 300.0
TEXTS = [
    '{"precision": 7, "recall": 3, "reason": "the prediction names one of the datasets"}',
    "You grade answers that quote evidence passages for a query.",
] * 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge-vllm")
    train_bpe(TEXTS, 300, root / "tokenizer")
    model = build_model(ModelConfig(preset="tiny", seed=0, dtype="float32", vocab_size=384))
    save_hf(model, root / "model", extra_files=tokenizer_files(root / "tokenizer"))
    port = free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115 (closed at teardown)
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(root / "model"), "--served-model-name", "judge"),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"),
            *(
                "--structured-outputs-config",
                '{"backend": "xgrammar", "disable_any_whitespace": true}',
            ),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        # Its ZeroMQ socket files (which vLLM never removes) in the test's folder, not in /tmp.
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(root)},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        began = time.monotonic()
        while True:
            if server.poll() is not None:
                pytest.fail(f"vLLM's server exited: {_tail(root / 'server.log')}")
            if time.monotonic() - began > START_TIMEOUT_S:
                pytest.fail(f"vLLM's server not up in {START_TIMEOUT_S:g} s")
            try:
                if httpx.get(f"{url}/models", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


def test_rubric_replies_decoded_to_the_schema_are_scored(judge_url):
    judge = RubricJudge(
        JudgeConfig(base_url=judge_url, model="judge", timeout_s=120.0, max_retries=0)
    )
    predictions = ["SQuAD", "SQuAD and HotpotQA", "nothing relevant", "HotpotQA"]

    async def score():
        try:
            return await judge.score_many("Which datasets?", "SQuAD and HotpotQA", predictions)
        finally:
            await judge.client.aclose()

    results = asyncio.run(score())
    for result in results:
        assert result.method == "judge", result.reason
        assert 1 <= result.precision <= 10 and 1 <= result.recall <= 10
        assert result.score == (result.precision - 1 + result.recall - 1) / 18
    stats = judge.client.stats
    # No retry and no fallback to json_object: the server took the schema and kept to it.
    assert (stats.requests, stats.retries, stats.failures) == (4, 0, 0), stats


SHOP = {
    "shop/__init__.py": "",
    "shop/cart.py": "from shop.prices import price_of\n\n\ndef total(items):\n"
    "    return sum(price_of(item) for item in items)\n",
    "shop/prices.py": "def price_of(item):\n    return round(item * 1.2, 2)\n",
}


def _train(config: str, run: Path, *overrides: str) -> dict:
    """`rlmtrain train --config config` into `run`, one RL step; that step's metrics row."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "rlmtrain", "train", "--config", config),
            *(f"--checkpoint.dir={run}", "--train.steps=1", "--eval.every=0"),
            *("--rollout.n_samples=2", "--judge.max_retries=0", "--logging.progress=false"),
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=RUN_HANG_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (rl,) = [r for r in rows if r["phase"] == "rl"]
    return rl


def test_an_rl_step_with_the_judged_tool_credit_and_step_rubric(judge_url, tmp_path):
    """One RL step of codenav whose tool credit and step rubric come from the server: every
    trajectory with turns asks each judge once, counted, and each reply decodes to the schema."""
    from rlmtrain.envs.base import write_tasks
    from rlmtrain.envs.codenav import generate_tasks

    for name, source in SHOP.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, generate_tasks(tmp_path / "shop", n=1, seed=0))
    rl = _train(
        "configs/tiny-cpu.toml",
        tmp_path / "run",
        *("--data.env=codenav", f"--data.train_path={tasks}", "--train.sft_steps=0"),
        *("--rollout.max_turns=2", "--rollout.max_new_tokens=64"),
        *("--model.tokenizer=byte", "--rollout.prompt_style=full"),
        *("--rollout.max_prompt_tokens=12288", "--algo.micro_batch_tokens=12544"),
        *("--algo.tool_credit_alpha=0.5", "--algo.tool_credit=judge"),
        *("--algo.step_rewards=judge", f"--judge.base_url={judge_url}"),
        *("--judge.max_tokens=256", "--judge.timeout_s=120"),
    )
    assert rl["roots_unscored"] == 0  # codenav's reward is verifiable
    asked = rl["credit_judge_calls"]
    assert asked >= 2 and rl["step_judge_calls"] == asked  # G = 2 roots at least, each once
    # The schema, which names the number of entries too, holds a random model to replies that
    # judge every trajectory: none falls back on the rules.
    assert rl["credit_judge_fallbacks"] == 0 and rl["step_judge_fallbacks"] == 0, rl
    assert all(0 <= rl[f"step_{c}"] <= 1 for c in ("relevance", "coherence"))


def test_booknav_config_runs_sft_and_an_rl_step_against_the_served_judge(judge_url, tmp_path):
    """`configs/booknav-cpu.toml` as shipped, pointed at the server and cut to a few tasks: the
    teacher's trees are graded by the proof judge (a random judge passes some), then an RL step
    whose rewards, tool credit and (switched on here) step rubric the server gives. Every root is
    scored or counted unscored, and each turn judge is asked once per trajectory with turns."""
    run = tmp_path / "run"
    rl = _train(
        "configs/booknav-cpu.toml",
        run,
        *(f"--judge.base_url={judge_url}", "--judge.cache_path=", "--algo.step_rewards=judge"),
        *("--data.sft_groups=8", "--data.synth_groups=2", "--train.sft_steps=2"),
        *("--train.tasks_per_step=2", "--logging.sample_trees=8"),
    )
    roots = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    roots = [r for r in roots if r["phase"] == "rl"]
    assert len(roots) == 4 == sum(rl["finish_reasons"].values())
    assert rl["roots_unscored"] == sum(r["score"] is None for r in roots)
    assert all(r["score"] is None or r["score"] in (-1.0, 1.0) for r in roots)
    with_turns = sum(bool(r["trajectories"][0]["turns"]) for r in roots)
    assert rl["credit_judge_calls"] == with_turns == rl["step_judge_calls"]
    assert rl["credit_judge_fallbacks"] <= with_turns and rl["step_judge_fallbacks"] <= with_turns
