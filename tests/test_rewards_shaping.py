"""Exploration bonus, rule-based tool credit and heuristic step rubrics, checked by hand."""

import math

import pytest

from rlmtrain.rewards.exploration import (
    beta_schedule,
    diversity_bonus,
    explored_reward,
    tree_turns,
)
from rlmtrain.rewards.novelty import novelty, word_ngrams
from rlmtrain.rewards.step_rubric import (
    StepRubricWeights,
    heuristic_step_rewards,
    heuristic_step_scores,
    query_keywords,
)
from rlmtrain.rewards.tool_credit import rule_credit, rule_labels
from rlmtrain.rlm.records import RolloutGroup, ToolCall, Trajectory, Turn


def turn(code="", output="", error="", calls=()) -> Turn:
    return Turn(
        prompt_ids=[1],
        completion_ids=[2],
        sampler_logprobs=[-0.1],
        code=code,
        output=output,
        error=error,
        tool_calls=[ToolCall(name=n, args=a) for n, a in calls],
    )


# --- exploration --------------------------------------------------------------------------------


def test_diversity_bonus_counts_distinct_normalised_calls():
    turns = [
        turn(calls=[("search", "'Prime'"), ("read_section", "'2.1'")]),
        turn(calls=[("search", '"prime"'), ("read_section", "'3.1'")]),
        turn(calls=[("FINAL", "'x'")]),
    ]
    # 4 tool calls (FINAL is not one); search('Prime') == search("prime") -> 3 distinct -> 3/4.
    assert diversity_bonus(turns) == 0.75
    assert diversity_bonus([turn(calls=[("FINAL_VAR", "'a'")])]) == 0.0
    assert diversity_bonus([]) == 0.0


def test_beta_cosine_schedule():
    assert beta_schedule(0, 100, 0.2) == pytest.approx(0.2)
    assert beta_schedule(25, 100, 0.2) == pytest.approx(0.2 * (1 + math.sqrt(0.5)) / 2)
    assert beta_schedule(50, 100, 0.2) == pytest.approx(0.1)
    assert beta_schedule(100, 100, 0.2) == pytest.approx(0.0)
    assert beta_schedule(150, 100, 0.2) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="total_steps"):
        beta_schedule(0, 0, 0.2)
    with pytest.raises(ValueError, match="step must be"):
        beta_schedule(-1, 10, 0.2)


def test_bonus_paid_only_on_success():
    assert explored_reward(1.0, 0.75, 0.1) == pytest.approx(1.075)
    assert explored_reward(-1.0, 0.75, 0.1) == -1.0
    assert explored_reward(0.5, 1.0, 0.1) == 0.5
    assert explored_reward(None, 1.0, 0.1) is None


def test_tree_turns_include_descendants():
    def traj(id_, parent, children, calls):
        return Trajectory(
            id=id_,
            root_id="r",
            parent_id=parent,
            depth=0 if parent is None else 1,
            task_id="t",
            sample_idx=0,
            prompt="q",
            turns=[turn(calls=calls)],
            children=children,
        )

    root = traj("r", None, ["c1", "c2"], [("search", "'a'")])
    group = RolloutGroup(
        task={},
        trajectories=[
            root,
            traj("c1", "r", [], [("search", "'a'")]),
            traj("c2", "r", [], [("read_section", "'1'")]),
        ],
    )
    turns = tree_turns(group, root)
    assert [t.tool_calls[0].args for t in turns] == ["'a'", "'a'", "'1'"]
    assert diversity_bonus(turns) == pytest.approx(2 / 3)
    # One walk, one rule: a child missing from the group is an error here as in the advantages,
    # not a smaller tree whose bonus would differ from the one the advantages see.
    broken = RolloutGroup(task={}, trajectories=group.trajectories[:2])
    with pytest.raises(ValueError, match="child c2 of r is not in the group"):
        tree_turns(broken, root)


# --- novelty and tool credit --------------------------------------------------------------------

T0 = "chapter one primes are numbers with two divisors"  # 8 words -> 6 trigrams


def test_novelty_by_hand():
    assert len(word_ngrams(T0)) == 6
    # 12 words -> 10 trigrams; the 4 that touch the new words are new -> 0.4.
    assert novelty(T0 + " and more text here", [T0]) == pytest.approx(0.4)
    assert novelty(T0, []) == 1.0
    assert novelty("", [T0]) == 0.0
    assert word_ngrams("two words") == {("two", "words")}


def test_rule_labels_by_hand():
    turns = [
        turn(output=T0, calls=[("search", "'prime'")]),  # new information        -> +1
        turn(error="NameError: x", calls=[("search", "'gcd'")]),  # error         -> -1
        turn(output="fresh text entirely new here", calls=[("search", '"Prime"')]),  # repeat -> 0
        turn(output=T0, calls=[("read_section", "'2'")]),  # new call, nothing new   ->  0
        turn(output=T0 + " and more text here"),  # novelty 0.4 < 0.5            ->  0
        turn(output="the gcd of a and b divides both"),  # no calls, all new      -> +1
    ]
    assert rule_labels(turns) == [1, -1, 0, 0, 0, 1]
    assert rule_labels(turns, novelty_threshold=0.4)[4] == 1
    assert rule_labels([]) == []


# --- step rubric --------------------------------------------------------------------------------

QUERY = "Which section proves that primes are infinite?"


def step_turns() -> list[Turn]:
    return [
        turn("hits = search_index('primes')\nprint(hits)", "2.3 Infinitude of primes"),
        turn(
            "text = read_section(hits[0])\nprint(text)",
            "Theorem. There are infinitely many primes. Proof by Euclid.",
        ),
        turn("hits = search_index('primes')\nprint(hits)", "2.3 Infinitude of primes"),
        turn("print('Euclid')", "Euclid"),
        turn("x = 1/0", "", error="ZeroDivisionError: division by zero"),
    ]


def test_query_keywords():
    assert query_keywords(QUERY) == {"section", "proves", "primes", "infinite"}


def test_heuristic_step_scores_by_hand():
    scores = heuristic_step_scores(QUERY, step_turns())
    got = [(s.relevance, s.info_gain, s.coherence) for s in scores]
    assert got == [
        (0.25, 1.0, 1.0),  # 'primes' of 4 keywords; all new; first turn
        (0.25, 1.0, 1.0),  # reads `hits`, assigned by turn 0
        (0.25, 0.0, 0.0),  # re-runs turn 0's code, learns nothing
        (0.0, 1.0, 0.5),  # new one-word output; uses no name or word of the history
        (0.0, 0.0, 0.0),  # error
    ]
    # total = 0.3·rel + 0.4·gain + 0.3·coh − 0.05
    assert [s.total for s in scores] == pytest.approx([0.725, 0.725, 0.025, 0.5, -0.05])


def test_step_coherence_from_previous_output_word_and_custom_weights():
    turns = [
        turn("print(search_index('primes'))", "2.3 Infinitude of primes"),
        turn("print(read_section('2.3'))  # infinitude", "Proof by Euclid."),
    ]
    # 'infinitude' (>= 4 letters, not in the query) carried from the previous output -> 1.0.
    second = heuristic_step_scores(QUERY, turns, StepRubricWeights(efficiency=0.5))[1]
    assert second.coherence == 1.0
    assert second.total == pytest.approx(0.3 * 0.0 + 0.4 * 1.0 + 0.3 * 1.0 - 0.5)
    assert heuristic_step_scores("the and", [turn("x=1", "")])[0].relevance == 1.0


def test_group_level_credit_and_step_rewards_by_trajectory_id():
    root = Trajectory(
        id="r",
        root_id="r",
        parent_id=None,
        depth=0,
        task_id="t",
        sample_idx=0,
        prompt=QUERY,
        turns=step_turns(),
        children=["r.0"],
    )
    child = Trajectory(
        id="r.0",
        root_id="r",
        parent_id="r",
        depth=1,
        task_id="t",
        sample_idx=0,
        prompt="read section 2.3",
        turns=[turn("print(read_section('2.3'))", "2.3 Infinitude of primes", calls=[("x", "")])],
    )
    group = RolloutGroup(task={}, trajectories=[root, child])
    credit = rule_credit(group)
    assert credit == {"r": rule_labels(root.turns), "r.0": [1]}
    steps = heuristic_step_rewards(group)
    assert steps["r"] == pytest.approx([0.725, 0.725, 0.025, 0.5, -0.05])
    # child: keywords {read, section}; the code's word is `read_section` (\w+ keeps it whole),
    # so relevance 0; all output new; first turn -> 0.3·0 + 0.4·1 + 0.3·1 − 0.05.
    assert steps["r.0"] == pytest.approx([0.65])
