"""The scripted evidence teacher through the real jailed REPL and trajectory loop: trees with
children on multi-paper tasks, span F1 against the gold evidence, records fit for SFT."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from rlmtrain.config import ConfigError, RolloutConfig, load_config
from rlmtrain.envs.evidence import EvidenceEnv
from rlmtrain.envs.evidence_teacher import (
    TEACHER_LIMITS,
    child_plan,
    child_prompt,
    compact_child_plan,
    compact_root_plan,
    parse_query,
    reply,
    root_plan,
)
from rlmtrain.envs.synth import synthesize
from rlmtrain.envs.teacher import fenced_code, flaw_of
from rlmtrain.model.bpe import train_bpe
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rlm.records import read_groups, write_groups
from rlmtrain.rollout.teaching import teach

MULTI_TASKS = 50
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env_and_tasks(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    synthesize(out, groups=32, seed=21, workers=2)
    env = EvidenceEnv()
    return env, env.load_tasks(out / "tasks.jsonl")


@pytest.mark.slow
def test_teacher_on_50_multi_paper_tasks(env_and_tasks, tmp_path):
    env, tasks = env_and_tasks
    multi = [task for task in tasks if len(task.paper_ids) >= 2][:MULTI_TASKS]
    assert len(multi) == MULTI_TASKS
    groups = asyncio.run(teach(env, multi, ByteTokenizer(), TEACHER_LIMITS))
    scores = []
    for task, group in zip(multi, groups, strict=True):
        (root,) = group.roots
        children = [t for t in group.trajectories if t.parent_id is not None]
        assert root.finish_reason == "final", (task.id, root.turns[-1].error)
        assert children and [c.id for c in children] == root.children
        calls = [c.name for turn in root.turns for c in turn.tool_calls]
        assert "rlm_query_batched" in calls and "list_papers" in calls
        for trajectory in group.trajectories:
            assert all(turn.error == "" for turn in trajectory.turns), trajectory.id
            assert all(turn.prompt_ids and turn.completion_ids for turn in trajectory.turns)
        for child in children:
            assert child.depth == 1 and child.finish_reason == "final" and child.answer
            assert child.prompt.startswith("Paper ID: ")
        # Exactly the papers the gold evidence comes from were read.
        relevant = {span.paper_id for span in task.evidence}
        assert {c.prompt.split("\n")[0].removeprefix("Paper ID: ") for c in children} == relevant
        result = asyncio.run(env.reward(task, group))
        scores.append(result.scores[0])
    mean = statistics.mean(scores)
    print(
        f"\nteacher span F1 on {len(scores)} multi-paper tasks: {mean:.3f} (min {min(scores):.3f})"
    )
    assert mean >= 0.8
    path = tmp_path / "teacher.jsonl"
    assert write_groups(path, groups) == len(groups)
    assert [g.trajectories[0].answer for g in read_groups(path)] == [
        r.roots[0].answer for r in groups
    ]


def test_teacher_single_paper_task_uses_no_children(env_and_tasks):
    env, tasks = env_and_tasks
    task = next(t for t in tasks if len(t.paper_ids) >= 2)
    single = type(task)(
        id="single",
        query=task.query,
        kind=task.kind,
        paper_ids=[task.evidence[0].paper_id],
        evidence=[task.evidence[0]],
    )
    (group,) = asyncio.run(teach(env, [single], ByteTokenizer(), TEACHER_LIMITS))
    (root,) = group.trajectories
    assert root.finish_reason == "final" and root.children == []
    assert 5 <= len(root.turns) <= 7
    assert asyncio.run(env.reward(single, group)).scores[0] >= 0.8


def test_plans_follow_the_query_and_refuse_strangers():
    rule = parse_query("Which method achieves the best BLEU on WMT14 En-De?")
    assert rule.family == "results" and rule.opening == "On WMT14 En-De,"
    assert parse_query("Which datasets are used to evaluate AstraNet?").relevant == "astranet:"
    prompt = child_prompt(
        "Paper ID: p\nTitle: T\nAbstract: A", "Which datasets are used to evaluate X?"
    )
    assert "We evaluate X" in "\n".join(child_plan(prompt))
    with pytest.raises(ValueError, match="no rule for query"):
        parse_query("What is the meaning of life?")
    with pytest.raises(ValueError, match="without a 'Query:' line"):
        child_plan("Paper ID: p\nno query here")


def test_teacher_warns_when_trajectories_do_not_finish(env_and_tasks, caplog):
    env, tasks = env_and_tasks
    task = next(t for t in tasks if len(t.paper_ids) >= 2)
    tight = RolloutConfig(max_turns=5, max_depth=1, max_prompt_tokens=2048)
    with caplog.at_level("WARNING", logger="rlmtrain"):
        (group,) = asyncio.run(teach(env, [task], ByteTokenizer(), tight))
    assert group.roots[0].finish_reason == "context"
    assert "1 of 1 trajectories did not finish (context: 1); max_prompt_tokens=2048" in caplog.text


def test_teacher_refuses_limits_without_children(env_and_tasks):
    env, tasks = env_and_tasks
    with pytest.raises(ValueError, match="needs rollout.max_depth >= 1"):
        asyncio.run(teach(env, tasks[:1], ByteTokenizer(), RolloutConfig(max_depth=0)))


def test_root_plan_sends_one_child_per_picked_paper(env_and_tasks):
    _, tasks = env_and_tasks
    task = next(t for t in tasks if len(t.paper_ids) >= 2)
    code = "\n".join(root_plan(task))
    assert "rlm_query_batched(prompts, contexts)" in code and 'FINAL_VAR("answer")' in code


def test_compact_teacher_through_the_scheduler(env_and_tasks):
    """The compact plans, played by the scheduler on the scripted engine: two turns per
    trajectory, one child per paper whose abstract names the query's key, the query as each
    child's prompt, and a span F1 close to the full plans'."""
    tasks = env_and_tasks[1]
    env = EvidenceEnv(env_and_tasks[0].corpus, prompt_style="compact")
    multi = [task for task in tasks if len(task.paper_ids) >= 2][:12]
    config = RolloutConfig(prompt_style="compact", max_turns=3, max_depth=1)
    groups = asyncio.run(teach(env, multi, ByteTokenizer(), config))
    scores = [s for ss in asyncio.run(env.root_scores(multi, groups)) for s in ss]
    for task, group in zip(multi, groups, strict=True):
        (root,) = group.roots
        children = [t for t in group.trajectories if t.parent_id is not None]
        key = parse_query(task.query).key
        picked = [p for p in task.paper_ids if key in env.corpus[p].abstract]
        assert root.finish_reason == "final" and len(root.turns) == 2
        assert [next(iter(c.turns)).code for c in children] and len(children) == len(picked)
        assert all(c.prompt == task.query and len(c.turns) == 2 for c in children)
    assert statistics.mean(scores) >= 0.8, scores


def test_flawed_children_quote_another_window_and_score_less(env_and_tasks):
    """With `teacher_flawed_share`, the flawed share of the queries' children quote the
    opening sentence alone or several past the passage (one token away from the plan), the
    others the plan's window; played through the scheduler, the flawed trees score less."""
    import re

    tasks = [task for task in env_and_tasks[1] if len(task.paper_ids) >= 2][:24]
    share = 0.67
    env = EvidenceEnv(env_and_tasks[0].corpus, prompt_style="compact", flawed_share=share)
    config = RolloutConfig(prompt_style="compact", max_turns=3, max_depth=1)
    groups = asyncio.run(teach(env, tasks, ByteTokenizer(), config))
    scores = [s for ss in asyncio.run(env.root_scores(tasks, groups)) for s in ss]
    by_window: dict[str, list[float]] = {}
    for task, group, score in zip(tasks, groups, scores, strict=True):
        children = [t for t in group.trajectories if t.parent_id is not None]
        windows = {re.search(r"window=(\d+)", c.turns[0].code)[1] for c in children}
        wanted = {None: "150", 0: "0", 1: "400"}[flaw_of(task.query, share, 2)]
        assert windows == {wanted}, (task.query, windows)
        by_window.setdefault(wanted, []).append(score)
    assert set(by_window) == {"150", "0", "400"}, by_window
    plan = statistics.mean(by_window["150"])
    assert max(statistics.mean(by_window["0"]), statistics.mean(by_window["400"])) < plan - 0.15
    with pytest.raises(ConfigError, match="data.teacher_flawed_share"):
        EvidenceEnv(flawed_share=share).teacher(RolloutConfig(max_turns=5))


def test_reply_reads_the_prompt_as_a_policy_would():
    query = "Which baselines are used to evaluate the methods based on label propagation?"
    root = f"<|im_start|>user\n`context` holds 3 papers.\nQuery: {query}\nTurn 1 of 3."
    assert compact_root_plan(query, 3)[0] in reply(root, "compact")
    child = f"<|im_start|>user\nQuery: {query}\nTurn 2 of 3.<|im_end|>\n<|im_start|>assistant\n"
    assert "FINAL_VAR" in reply(child, "compact")
    assert reply(child.replace("Turn 2", "Turn 3"), "compact") == ""
    with pytest.raises(ValueError, match="no query or turn"):
        reply("<|im_start|>user\nhello", "compact")


def test_teacher_repls_keep_the_configured_output_limit(env_and_tasks):
    """The teacher's REPLs are the run's: `rollout.output_limit_chars` clips what they keep."""
    import re

    env, tasks = env_and_tasks
    multi = [task for task in tasks if len(task.paper_ids) >= 3][:2]
    config = RolloutConfig(
        max_turns=5, max_depth=1, max_prompt_tokens=32768, max_new_tokens=2048,
        output_limit_chars=500,
    )  # fmt: skip
    groups = asyncio.run(teach(env, multi, ByteTokenizer(), config))
    outputs = [turn.output for g in groups for t in g.trajectories for turn in t.turns]
    marker = re.compile(r"\n\.\.\. \[(\d+) characters cut\] \.\.\.\n")
    cut = [out for out in outputs if marker.search(out)]
    assert cut, "no output was long enough to be clipped"
    assert all(len(marker.sub("", out)) <= 500 for out in outputs)


def test_compact_replies_fit_the_default_turn(env_and_tasks, tmp_path):
    """Every block of the compact plans, fenced as the teacher replies, fits the embedded
    default's `rollout.max_new_tokens` with room to spare under a BPE trained as the run trains
    one (on `vocabulary_texts`): a cut reply would teach SFT a turn that never runs."""
    env, tasks = env_and_tasks
    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.toml"), [])
    share = cfg.data.teacher_flawed_share
    env = EvidenceEnv(env.corpus, prompt_style="compact", flawed_share=share)
    tok = train_bpe(env.vocabulary_texts(tasks), cfg.model.bpe_vocab_size, tmp_path / "tok")
    blocks = [
        block
        for task in tasks
        for block in compact_root_plan(task.query, len(task.paper_ids), share)
        + compact_child_plan(task.query, share)
    ]
    longest = max(len(tok.encode(fenced_code(block))) for block in blocks)
    assert longest <= cfg.rollout.max_new_tokens - 8, longest
