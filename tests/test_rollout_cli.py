"""`rlmtrain rollout` end to end on the embedded config, shrunk: one synthetic paper group, one
task, two trees of one short turn, the native engine with the random tiny model, the real REPL.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlmtrain.cli import main
from rlmtrain.rlm.records import read_groups

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"


@pytest.mark.slow
def test_rollout_writes_groups_and_a_summary(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rollouts.jsonl"
    code = main(
        [
            "rollout",
            "--config",
            str(CONFIG),
            "--out",
            str(out),
            "--limit",
            "1",
            f"--checkpoint.dir={tmp_path / 'run'}",
            "--data.synth_groups=1",
            "--rollout.n_samples=2",
            "--rollout.max_turns=1",
            "--rollout.max_new_tokens=8",
            "--model.tokenizer=byte",
        ]
    )
    assert code == 0
    [group] = list(read_groups(out))
    assert [root.sample_idx for root in group.roots] == [0, 1]
    for trajectory in group.trajectories:
        assert trajectory.finish_reason in ("max_turns", "final", "error")
        for turn in trajectory.turns:
            assert 1 <= len(turn.completion_ids) <= 8
            assert len(turn.sampler_logprobs) == len(turn.completion_ids)
    captured = capsys.readouterr()
    summary = captured.out
    assert f"wrote 1 groups to {out}" in summary
    assert "2 trees" in summary and "mean root reward" in summary
    # The progress bar counts from where the engine's counters stood when it began.
    rates = re.findall(r"tok_s=(\d+)", captured.err)
    assert rates and int(rates[-1]) > 0, captured.err[-500:]


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    code = main(
        ["rollout", "--config", str(CONFIG), "--out", str(tmp_path / "x"), "--rollout.nope=1"]
    )
    assert code == 2
    assert "unknown key 'rollout.nope'" in capsys.readouterr().err
