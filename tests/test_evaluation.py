"""Held-out evaluation: exact numbers from hand-built trees, the real pipeline with a scripted
engine (scores, spawns, tool calls), reproducibility on the random tiny model, and `rlmtrain
eval` on a saved checkpoint, including the bad-checkpoint paths that must end in one line and
exit code 2.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from clocks import RUN_HANG_S
from scripted_model import code, script_reply

from rlmtrain.cli import main as rlmtrain_main
from rlmtrain.config import Config
from rlmtrain.envs.base import Task, write_tasks
from rlmtrain.envs.evidence import EvidenceEnv, EvidenceSpan, EvidenceTask
from rlmtrain.envs.pdf import Paper, write_corpus
from rlmtrain.evaluation import TIMING_KEYS, evaluate, format_report, pass_at_k, summarize
from rlmtrain.model import build_model, save_hf
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rlm.records import RolloutGroup, ToolCall, Trajectory, Turn
from rlmtrain.rollout.engines.sim import SimEngine, text_script

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ByteTokenizer()

GOLD = {"p0": "We evaluate on CIFAR-10 and SVHN.", "p1": "We train on ImageNet only."}
PAPERS = {
    pid: Paper(id=pid, title=f"Paper {pid}", abstract="A study.", text=f"Intro. {gold} The end.")
    for pid, gold in GOLD.items()
}


def _span(pid: str) -> EvidenceSpan:
    start = PAPERS[pid].text.index(GOLD[pid])
    return EvidenceSpan(paper_id=pid, start=start, end=start + len(GOLD[pid]), text=GOLD[pid])


TASKS = [
    EvidenceTask(
        id="one",
        query="Which datasets?",
        paper_ids=["p0"],
        evidence=[_span("p0")],
        kind="datasets",
    ),
    EvidenceTask(
        id="two",
        query="Which training data?",
        paper_ids=["p0", "p1"],
        evidence=[_span("p1")],
        kind="results",
    ),
]


# ---------------------------------------------------------------------------------------------
# summarize on hand-built trees
# ---------------------------------------------------------------------------------------------


def turn(*calls: str, started: float = 0.0, ended: float = 0.0) -> Turn:
    tool_calls = [ToolCall(name=name) for name in calls]
    return Turn(
        prompt_ids=[0],
        completion_ids=[1, 2, 3],
        sampler_logprobs=[-1.0] * 3,
        tool_calls=tool_calls,
        started=started,
        ended=ended,
    )


def node(tid: str, turns: list[Turn], reason: str, *, answer=None, children=()) -> Trajectory:
    """A trajectory whose id encodes its place: 'task#k' a root, 'task#k.i.j' a descendant."""
    root_id, _, path = tid.partition(".")
    parent = None if not path else tid.rsplit(".", 1)[0]
    return Trajectory(
        id=tid,
        root_id=root_id,
        parent_id=parent,
        depth=len(path.split(".")) if path else 0,
        task_id=root_id.split("#")[0],
        sample_idx=int(root_id.split("#")[1]),
        prompt="q",
        turns=turns,
        children=list(children),
        answer=answer,
        finish_reason=reason,
    )


def hand_built() -> tuple[list[RolloutGroup], list[list[float | None]]]:
    one = RolloutGroup(
        task=TASKS[0],
        trajectories=[
            # Listed out of sample order: `roots` sorts them, and scores follow that order.
            node("one#1", [turn(), turn(), turn()], "max_turns"),
            node(
                "one#0",
                [
                    turn("search", started=100.0, ended=101.0),
                    turn("search", started=102.0, ended=104.0),
                ],
                "final",
                answer=GOLD["p0"],
            ),
        ],
    )
    two = RolloutGroup(
        task=TASKS[1],
        trajectories=[
            node(
                "two#0",
                [turn("rlm_query_batched", started=10.0, ended=20.0)],
                "final",
                answer=GOLD["p1"],
                children=["two#0.0", "two#0.1"],
            ),
            node("two#0.0", [turn("search", started=12.0, ended=25.0)], "final", answer="x"),
            node("two#0.1", [turn(), turn()], "max_turns"),
            node("two#0.0.0", [], "error"),
            # Called rlm_query but every prompt was refused: spawned, without children.
            node("two#1", [turn("rlm_query")], "timeout"),
        ],
    )
    return [one, two], [[0.4, 0.0], [0.8, None]]


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - math.comb(3, 3) / math.comb(5, 3))  # 0.9
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer failures than k: some pass in every draw
    assert pass_at_k(4, 1, 1) == 0.25
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_summarize_hand_built_groups() -> None:
    groups, scores = hand_built()
    report = summarize(TASKS, groups, scores, samples=2, seconds=7.5)
    expected = {
        "tasks": 2,
        "samples": 2,
        "roots": 4,
        "reward_mean": pytest.approx((0.4 + 0.0 + 0.8) / 3),  # the None is not a 0
        # Over the tasks' means, 0.2 and 0.8: their sample deviation over the root of two.
        "reward_stderr": pytest.approx(math.sqrt(0.18) / math.sqrt(2)),
        "task_rewards": {"one": pytest.approx(0.2), "two": 0.8},
        "reward_by_kind": {"datasets": pytest.approx(0.2), "results": 0.8},
        "unscored": 1,
        "pass_k": 2,
        "pass_threshold": 0.5,
        # 'one': no root >= 0.5 -> 0; 'two': its one scored root passes -> 1.
        "pass_at_k": 0.5,
        "pass_at_1": 0.5,
        # Against the gold spans, whatever the reward said: one#0 and two#0 exact, the rest none.
        "span_f1": 0.5,
        "turns_mean": (2 + 3 + 1 + 1) / 4,
        "turns_per_trajectory": (2 + 3 + 1 + 1 + 1 + 2 + 0) / 7,
        "children_per_root": 3 / 4,  # two#0 has two children and one grandchild
        "spawn_rate": 0.5,
        "spawn_rate_multi": 1.0,
        "finish_reasons": {
            "roots": {"final": 2, "max_turns": 1, "timeout": 1},
            "children": {"error": 1, "final": 1, "max_turns": 1},
        },
        "tool_calls": {"rlm_query": 1, "rlm_query_batched": 1, "search": 3},
        "tool_calls_per_trajectory": None,  # the env's tools were not named
        "distinct_tool_share": None,
        "pass_metric": None,
        "generated_tokens": 3 * 10,
        "wall_s_per_tree": (4.0 + 15.0) / 2,  # trees with timed turns: one#0, two#0
        "seconds": 7.5,
    }
    digest = report.pop("sample_digest")
    rubric = [report.pop(f"step_{c}") for c in ("relevance", "info_gain", "coherence")]
    assert all(0 <= value <= 1 for value in rubric), rubric
    assert report == expected
    assert len(digest) == 8
    groups[1].trajectories[2].turns[0].completion_ids = [1, 2, 4]  # one token of a child
    assert summarize(TASKS, groups, scores, samples=2, seconds=0)["sample_digest"] != digest


def test_summarize_tool_use_and_a_verdict_pass_rate() -> None:
    groups, _ = hand_built()
    report = summarize(
        TASKS,
        groups,
        [[1.0, -1.0], [1.0, None]],
        samples=2,
        seconds=0,
        tools=["search", "extract_section"],
        pass_metric="proof_pass_rate",
    )
    # Seven trajectories; one#0 calls search twice and two#0.0 once; rlm_query is no env tool.
    assert report["tool_calls_per_trajectory"] == pytest.approx(3 / 7)
    assert report["distinct_tool_share"] == pytest.approx((1 / 2 + 1 / 2) / 7)
    assert report["pass_metric"] == "proof_pass_rate"
    assert report["proof_pass_rate"] == pytest.approx(2 / 3)  # the unscored root left out
    text = format_report(report)
    assert "proof pass rate" in text and "66.7%" in text
    assert "tool calls per trajectory" in text and "0.43" in text


def test_summarize_threshold_and_missing_metrics() -> None:
    groups, scores = hand_built()
    report = summarize(TASKS, groups, scores, samples=2, seconds=0, pass_threshold=0.3)
    assert report["pass_at_k"] == 1.0 and report["pass_at_1"] == 0.75
    assert report["pass_threshold"] == 0.3
    text = format_report({"phase": "eval", "step": 3, **report})
    assert "pass@2 (score >= 0.3)" in text and "1.0000" in text
    assert "0.4000 ± 0.3000 (standard error over tasks)" in text
    assert "final=2 max_turns=1 timeout=1" in text
    assert "datasets=0.200 results=0.800" in text

    # Tasks without gold evidence or papers: span F1 and the multi-paper rate do not apply.
    plain = [Task(id="one", query="q"), Task(id="two", query="q")]
    report = summarize(plain, groups, [[None, None], [None, None]], samples=2, seconds=0)
    assert report["span_f1"] is None and report["spawn_rate_multi"] is None
    assert report["reward_by_kind"] is None
    assert report["reward_mean"] is None and report["pass_at_k"] is None
    assert report["reward_stderr"] is None and report["task_rewards"] == {}
    assert report["unscored"] == 4
    assert "-" in format_report(report)


def test_summarize_rejects_misaligned_scores() -> None:
    groups, scores = hand_built()
    with pytest.raises(ValueError, match="2 roots but 3 scores"):
        summarize(TASKS, groups, [[0.1, 0.2, 0.3], scores[1]], samples=2, seconds=0)
    with pytest.raises(ValueError, match="score lists"):
        summarize(TASKS, groups, scores[:1], samples=2, seconds=0)


# ---------------------------------------------------------------------------------------------
# evaluate(): the real scheduler, REPL and reward
# ---------------------------------------------------------------------------------------------


def eval_config(**sections: dict) -> Config:
    raw = {
        "model": {"attention": "sdpa"},
        "rollout": {"max_turns": 2, "max_depth": 1, "max_new_tokens": 16},
        "train": {"device": "cpu"},
        "eval": {"samples": 2},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return msgspec.convert(raw, Config)


def test_evaluate_scores_spawns_on_a_given_engine() -> None:
    """A scripted policy: on the two-paper task the root asks one child per call and returns its
    answer (the gold passage); on the one-paper task it answers wrongly."""

    def script(query: str, turn: int) -> str:
        if query == TASKS[1].query:
            return code("a = rlm_query_batched(['find it'], [context])", "FINAL(a[0])")
        if query == "find it":
            return code(f"FINAL({GOLD['p1']!r})")
        return code("FINAL('no idea')")

    engine = SimEngine(
        script=text_script(TOKENIZER, lambda prompt: script_reply(script, prompt)),
        eos_id=TOKENIZER.eos_id,
        decode=TOKENIZER.decode,
    )
    cfg = eval_config(rollout={"max_new_tokens": 256})

    async def run() -> dict:
        try:
            report = await evaluate(cfg, None, TOKENIZER, EvidenceEnv(PAPERS), TASKS, engine=engine)
            # The caller's engine is left running.
            again = await evaluate(cfg, None, TOKENIZER, EvidenceEnv(PAPERS), TASKS, engine=engine)
            assert again["reward_mean"] == report["reward_mean"]
            return report
        finally:
            await engine.close()

    report = asyncio.run(run())
    assert (report["tasks"], report["roots"]) == (2, 4)
    assert report["pass_at_k"] == 0.5 and report["pass_at_1"] == 0.5
    assert report["span_f1"] == pytest.approx(report["reward_mean"])  # no judge: reward = span F1
    assert report["reward_mean"] == pytest.approx(0.5, abs=0.05)  # 1.0 on 'two', ~0 on 'one'
    assert report["spawn_rate"] == 0.5 and report["spawn_rate_multi"] == 1.0
    assert report["children_per_root"] == 0.5
    assert report["finish_reasons"] == {"roots": {"final": 4}, "children": {"final": 2}}
    assert report["tool_calls"] == {"rlm_query_batched": 2}
    # The env's tools, read from its tool modules; spawning is none of them.
    tools = EvidenceEnv(PAPERS).tool_names()
    assert tools == ["list_papers", "search", "extract_section", "get_paper_abstract"]
    assert report["tool_calls_per_trajectory"] == 0.0 and report["distinct_tool_share"] == 0.0
    assert report["pass_metric"] is None  # span F1 is graded, not a verdict
    assert report["turns_mean"] == 1.0 and report["wall_s_per_tree"] > 0


class QuickEvidence(EvidenceEnv):
    """The evidence env with a one-line strategy and no tool docs: a prompt of ~1.3k byte
    tokens instead of ~6k, so the random tiny model prefills in a fraction of a second."""

    def system_prompt(self) -> str:
        return "Quote the passages that answer the query."

    def tool_modules(self) -> list[str]:
        return []


@pytest.mark.slow
def test_evaluate_is_reproducible_on_the_tiny_model() -> None:
    cfg = eval_config()
    model = build_model(cfg.model)

    def report(cfg: Config) -> dict:
        return asyncio.run(evaluate(cfg, model, TOKENIZER, QuickEvidence(PAPERS), TASKS))

    first, second = report(cfg), report(cfg)
    assert first["roots"] == 4 and first["generated_tokens"] > 0
    timeless = lambda r: {k: v for k, v in r.items() if k not in TIMING_KEYS}
    assert timeless(first) == timeless(second)
    other = report(msgspec.structs.replace(cfg, eval=msgspec.structs.replace(cfg.eval, seed=7)))
    assert other["sample_digest"] != first["sample_digest"]


# ---------------------------------------------------------------------------------------------
# rlmtrain eval
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder with a saved tiny checkpoint in final/ and held-out tasks in heldout/."""
    run = tmp_path / "run"
    save_hf(build_model(Config().model), run / "final")
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    write_corpus(heldout / "corpus.jsonl", PAPERS.values())
    write_tasks(heldout / "tasks.jsonl", TASKS)
    return run


def eval_args(run_dir: Path, *extra: str) -> list[str]:
    return [
        "eval",
        f"--checkpoint.dir={run_dir}",
        "--model.tokenizer=byte",
        "--rollout.engine=native",
        f"--data.eval_path={run_dir.parent / 'heldout' / 'tasks.jsonl'}",
        "--rollout.max_turns=1",
        "--rollout.max_new_tokens=8",
        "--model.attention=sdpa",
        *extra,
    ]


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmtrain", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=RUN_HANG_S,
    )


@pytest.mark.slow
def test_cli_prints_the_report_and_writes_json(run_dir: Path) -> None:
    out = run_dir.parent / "report.json"
    result = run_cli(eval_args(run_dir, "--samples", "1", "--tasks", "1", "--out", str(out)))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report == json.loads(out.read_text())
    assert (report["phase"], report["tasks"], report["samples"], report["roots"]) == (
        "eval",
        1,
        1,
        1,
    )
    assert sum(report["finish_reasons"]["roots"].values()) == 1
    assert report["generated_tokens"] > 0
    assert any(line.startswith("eval step 0: 1 tasks x 1 samples") for line in lines)


@pytest.mark.slow
def test_cli_refuses_an_unwritable_out_before_evaluating(run_dir: Path) -> None:
    """Minutes of evaluation are not lost to a bad --out: it is refused before they start."""
    out = run_dir.parent / "no-such-folder" / "report.json"
    result = run_cli(eval_args(run_dir, "--samples", "1", "--tasks", "1", "--out", str(out)))
    assert_one_line_exit_2(result, "--out", str(out), "does not exist")
    assert result.stdout == ""


def assert_one_line_exit_2(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("rlmtrain eval: error: ")
    for needle in needles:
        assert needle in line, line


def test_cli_missing_checkpoint_folder(run_dir: Path) -> None:
    missing = run_dir / "nope"
    result = run_cli(eval_args(run_dir, "--checkpoint", str(missing)))
    assert_one_line_exit_2(result, str(missing), "not found")


def test_cli_truncated_weights(run_dir: Path) -> None:
    weights = run_dir / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_one_line_exit_2(run_cli(eval_args(run_dir)), str(weights))


def test_cli_garbage_config(run_dir: Path) -> None:
    config = run_dir / "final" / "config.json"
    config.write_bytes(b"\xff\xfe\x00 not json")
    assert_one_line_exit_2(run_cli(eval_args(run_dir)), str(config))


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("config.json", b"{not json", "config.json"),
        ("config.json", b"[1, 2]", "not a JSON object"),
        ("config.json", b'{"model_type": "qwen3"}', "missing key"),
        ("config.json", b'{"model_type": "gpt2"}', "not supported"),
        ("config.json", None, "no config.json"),
        ("model.safetensors", None, "model.safetensors"),
        ("model.safetensors", b"\x00" * 16, "model.safetensors"),
    ],
)
def test_bad_checkpoint_is_one_line(run_dir, capsys, name, content, needle) -> None:
    path = run_dir / "final" / name
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content)
    assert rlmtrain_main(eval_args(run_dir)) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert needle in line and str(run_dir / "final") in line, line


def test_missing_heldout_file_is_one_line(run_dir, capsys) -> None:
    args = [a for a in eval_args(run_dir) if not a.startswith("--data.eval_path")]
    missing = run_dir / "none.jsonl"
    assert rlmtrain_main([*args, f"--data.eval_path={missing}"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rlmtrain eval: error: data.eval_path:") and str(missing) in line, line


def test_default_checkpoint_is_final_else_the_configs_model(run_dir, capsys) -> None:
    """Without --checkpoint: the run's final/, and where the run has none yet, the config's own
    starting model (the zero-shot figures), said on stderr."""
    assert rlmtrain_main(eval_args(run_dir)) == 0
    assert "holds no checkpoint" not in capsys.readouterr().err
    shutil.rmtree(run_dir / "final")
    assert rlmtrain_main(eval_args(run_dir)) == 0
    captured = capsys.readouterr()
    assert f"{run_dir / 'final'} holds no checkpoint" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["roots"] > 0


def test_checkpoint_tokenizer_is_used_and_checked(run_dir, capsys) -> None:
    """A tokenizer.json in the checkpoint folder takes precedence over model.tokenizer."""
    (run_dir / "final" / "tokenizer.json").write_text("{}")
    assert rlmtrain_main(eval_args(run_dir)) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert str(run_dir / "final") in line and "tokenizer" in line, line
