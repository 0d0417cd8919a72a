"""The run log: JSON lines on disk, TensorBoard events read back, sample trees, plot, table, W&B.

Each test drives `RunLog` the way the training script does and reads what a user would read
afterwards: the files, the event files through tensorboard's own reader, the PNG's signature.
"""

import json
import sys
import types
from pathlib import Path

import msgspec
import pytest

from rlmtrain import runlog
from rlmtrain.config import Config, ConfigError
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn
from rlmtrain.runlog import RunLog

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_config(run_dir: Path, **logging) -> Config:
    cfg = Config()
    defaults = {"progress": False, "tensorboard": False, "plot": False}
    return msgspec.structs.replace(
        cfg,
        checkpoint=msgspec.structs.replace(cfg.checkpoint, dir=str(run_dir)),
        logging=msgspec.structs.replace(cfg.logging, **{**defaults, **logging}),
        train=msgspec.structs.replace(cfg.train, sft_steps=3, steps=4),
    )


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sft_row(step: int, loss: float) -> dict:
    return {"phase": "sft", "step": step, "loss": loss, "tokens": 600, "seconds": 2.0}


def rl_row(step: int, reward: float) -> dict:
    return {
        "phase": "rl",
        "step": step,
        "reward_mean": reward,
        "loss": 0.1,
        "tokens": 900,
        "seconds": 3.0,
        "finish_reasons": {"final": 3, "max_turns": 1},
        "note": "strings are kept in JSON only",
    }


def turn(code: str, output: str, error: str = "") -> Turn:
    return Turn(
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        sampler_logprobs=[-0.1, -0.2],
        code=code,
        output=output,
        error=error,
    )


def make_group(task_id: str) -> RolloutGroup:
    """Two roots; root 0 spawned one child, which spawned a grandchild."""
    r0 = Trajectory(
        id=f"{task_id}-r0",
        root_id=f"{task_id}-r0",
        parent_id=None,
        depth=0,
        task_id=task_id,
        sample_idx=0,
        prompt="Where is total defined?",
        turns=[turn("print(rlm_query('look'))", "shop/cart.py"), turn("FINAL('cart.py')", "")],
        children=[f"{task_id}-c0"],
        answer="cart.py",
        finish_reason="final",
    )
    c0 = Trajectory(
        id=f"{task_id}-c0",
        root_id=r0.id,
        parent_id=r0.id,
        depth=1,
        task_id=task_id,
        sample_idx=0,
        prompt="look",
        turns=[turn("open('x')", "", error="FileNotFoundError: x")],
        children=[f"{task_id}-g0"],
        answer="shop/cart.py",
        finish_reason="final",
    )
    g0 = Trajectory(
        id=f"{task_id}-g0",
        root_id=r0.id,
        parent_id=c0.id,
        depth=2,
        task_id=task_id,
        sample_idx=0,
        prompt="deeper",
        finish_reason="max_turns",
    )
    r1 = Trajectory(
        id=f"{task_id}-r1",
        root_id=f"{task_id}-r1",
        parent_id=None,
        depth=0,
        task_id=task_id,
        sample_idx=1,
        prompt="Where is total defined?",
        turns=[turn("print(1)", "1")],
        finish_reason="max_turns",
    )
    # Stored out of order: the sample log must follow the links, not the list.
    return RolloutGroup(task={"id": task_id}, trajectories=[g0, r1, c0, r0])


def eval_report(phase: str, step: int, reward: float, **extra) -> dict:
    return {
        "phase": phase,
        "step": step,
        "reward_mean": reward,
        "tasks": 12,
        "children_per_root": 1.5,
        "spawn_rate": 0.25,
        "spawn_rate_multi": 0.75,
        **extra,
    }


# ---------------------------------------------------------------- JSON lines


def test_rows_land_in_metrics_jsonl_flushed_and_appended(tmp_path):
    cfg = make_config(tmp_path)
    with RunLog(cfg, tmp_path) as run:
        run.step(sft_row(0, 2.5))
        run.step(rl_row(0, 0.5))
        # Flushed at once: readable before close, as after a kill.
        rows = read_lines(tmp_path / "metrics.jsonl")
        assert [r["phase"] for r in rows] == ["sft", "rl"]
        assert rows[1]["finish_reasons"] == {"final": 3, "max_turns": 1}
        assert rows[1]["note"] == "strings are kept in JSON only"
    with RunLog(cfg, tmp_path) as run:
        run.step(rl_row(1, 0.75))
    assert [r["step"] for r in read_lines(tmp_path / "metrics.jsonl")] == [0, 0, 1]


def test_metrics_path_overrides_run_dir(tmp_path):
    target = tmp_path / "elsewhere" / "m.jsonl"
    with RunLog(make_config(tmp_path, metrics_path=str(target)), tmp_path / "run") as run:
        run.step(sft_row(0, 1.0))
    assert read_lines(target) == [sft_row(0, 1.0)]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_jsonl_one_object_per_call_at_the_global_step(tmp_path):
    with RunLog(make_config(tmp_path), tmp_path) as run:
        run.eval(eval_report("init", 0, 0.1))
        for step in range(3):
            run.step(sft_row(step, 1.0))
        run.eval(eval_report("sft", 3, 0.2))
        run.step(rl_row(0, 0.5))
        run.eval(eval_report("final", 1, 0.3, pass_at_k=0.5))
    reports = read_lines(tmp_path / "eval.jsonl")
    assert [r["phase"] for r in reports] == ["init", "sft", "final"]
    assert [r["global_step"] for r in reports] == [0, 3, 4]
    assert reports[2]["pass_at_k"] == 0.5 and reports[1]["reward_mean"] == 0.2


def test_bad_phase_is_refused(tmp_path):
    with RunLog(make_config(tmp_path), tmp_path) as run:
        with pytest.raises(ValueError, match="'eval'"):
            run.step({"phase": "eval", "step": 0})
        with pytest.raises(ValueError, match="step"):
            run.step({"phase": "rl"})
        with pytest.raises(ValueError, match="'train'"):
            run.eval(eval_report("train", 0, 0.0))


# ---------------------------------------------------------------- sample trees


def test_samples_are_decoded_trees_in_link_order(tmp_path):
    groups = [make_group("t0"), make_group("t1")]
    scores = [[1.0, 0.0], [None, 0.5]]
    with RunLog(make_config(tmp_path, sample_trees=3), tmp_path) as run:
        run.samples("rl", 2, groups, scores)
    lines = read_lines(tmp_path / "samples.jsonl")
    assert [(s["task_id"], s["root_id"], s["score"]) for s in lines] == [
        ("t0", "t0-r0", 1.0),
        ("t0", "t0-r1", 0.0),
        ("t1", "t1-r0", None),
    ]
    first = lines[0]
    assert first["phase"] == "rl" and first["step"] == 2 and first["global_step"] == 3 + 2 + 1
    trajs = first["trajectories"]
    assert [(t["id"], t["parent_id"], t["depth"]) for t in trajs] == [
        ("t0-r0", None, 0),
        ("t0-c0", "t0-r0", 1),
        ("t0-g0", "t0-c0", 2),
    ]
    assert trajs[0]["answer"] == "cart.py" and trajs[2]["finish_reason"] == "max_turns"
    assert trajs[0]["turns"][0] == {
        "code": "print(rlm_query('look'))",
        "output": "shop/cart.py",
        "error": "",
    }
    assert trajs[1]["turns"][0]["error"] == "FileNotFoundError: x"
    assert trajs[1]["prompt"] == "look"
    text = (tmp_path / "samples.jsonl").read_text()
    assert "_ids" not in text and "logprobs" not in text
    assert [len(s["trajectories"]) for s in lines] == [3, 1, 3]


def test_sample_trees_zero_writes_no_file(tmp_path):
    with RunLog(make_config(tmp_path, sample_trees=0), tmp_path) as run:
        run.samples("rl", 0, [make_group("t0")], [[1.0, 0.0]])
    assert not (tmp_path / "samples.jsonl").exists()


# ---------------------------------------------------------------- TensorBoard


@pytest.mark.skipif(not runlog.HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_scalars_and_histograms_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLog(make_config(tmp_path, tensorboard=True), tmp_path) as run:
        run.eval(eval_report("init", 0, 0.1))
        run.step(sft_row(0, 2.5))
        run.step(sft_row(2, 1.5))  # step 1 skipped: the global step keeps its place
        run.step(rl_row(0, 0.5))
        run.step(rl_row(1, 0.75))
        run.histograms("rl", 1, advantage=[0.5, -0.5, 1.0], empty=[])
        run.eval(eval_report("final", 2, 0.4))
    events = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "sft/loss",
        "sft/tokens",
        "rl/reward_mean",
        "rl/loss",
        "rl/finish_reasons/final",
        "rl/finish_reasons/max_turns",
        "eval/reward_mean",
        "eval/spawn_rate",
        "eval/tasks",
    }
    assert expected <= tags
    assert not {t for t in tags if t.endswith(("/note", "/phase", "/step"))}

    def curve(tag):
        return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]

    assert curve("sft/loss") == [(1, 2.5), (3, 1.5)]
    assert curve("rl/reward_mean") == [(4, 0.5), (5, 0.75)]
    assert curve("rl/finish_reasons/final") == [(4, 3.0), (5, 3.0)]
    assert curve("eval/reward_mean") == [(0, 0.1), (5, 0.4)]
    assert acc.Tags()["histograms"] == ["rl/advantage"]
    (hist,) = acc.Histograms("rl/advantage")
    assert hist.step == 5 and hist.histogram_value.num == 3


def test_missing_tensorboard_logs_one_line_and_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runlog, "HAS_TENSORBOARD", False)
    caplog.set_level("INFO", logger="rlmtrain.runlog")
    with RunLog(make_config(tmp_path, tensorboard=True), tmp_path) as run:
        run.step(sft_row(0, 1.0))
        run.histograms("sft", 0, entropy=[1.0])
    assert [r.message for r in caplog.records if "tensorboard" in r.message]
    assert not (tmp_path / "tb").exists()
    assert read_lines(tmp_path / "metrics.jsonl") == [sft_row(0, 1.0)]


# ---------------------------------------------------------------- plot and table


def test_curves_png_after_close(tmp_path):
    with RunLog(make_config(tmp_path, plot=True), tmp_path) as run:
        run.eval(eval_report("init", 0, 0.1))
        for step in range(3):
            run.step(sft_row(step, 2.0 - step * 0.5))
        run.eval(eval_report("sft", 3, 0.2))
        for step in range(4):
            run.step(rl_row(step, 0.25 * step))
        run.eval(eval_report("final", 4, float("nan")))
        assert not (tmp_path / "curves.png").exists()
    data = (tmp_path / "curves.png").read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000


@pytest.mark.parametrize("what", ["nothing", "sft only", "rl only", "eval only"])
def test_curves_png_when_phases_are_missing(tmp_path, what):
    with RunLog(make_config(tmp_path, plot=True), tmp_path) as run:
        if what == "sft only":
            run.step(sft_row(0, 1.0))
        if what == "rl only":
            run.step(rl_row(0, 1.0))
        if what == "eval only":
            run.eval(eval_report("init", 0, 0.1))
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_curves_name_the_ends_a_mid_run_point_goes_unnamed(tmp_path, monkeypatch):
    figures = []

    def kept(*args):
        figures.append(real(*args))
        return figures[-1]

    real = runlog._figure
    monkeypatch.setattr(runlog, "_figure", kept)
    with RunLog(make_config(tmp_path, plot=True), tmp_path) as run:
        run.eval(eval_report("init", 0, 0.1))
        run.eval(eval_report("sft", 3, 0.2))
        run.eval(eval_report("rl", 2, 0.3))
        run.eval(eval_report("final", 4, 0.4))  # a finished run, then given more RL steps
        run.eval(eval_report("final", 6, 0.5))
    (fig,) = figures
    (eval_ax,) = [ax for ax in fig.axes if ax.get_title() == "held-out evaluation"]
    assert [text.get_text() for text in eval_ax.texts] == ["init", "after SFT", "after RL"]


def test_plot_off_writes_no_png(tmp_path):
    with RunLog(make_config(tmp_path, plot=False), tmp_path) as run:
        run.step(sft_row(0, 1.0))
    assert not (tmp_path / "curves.png").exists()


def test_summary_table_rows_in_order_and_aligned(tmp_path):
    run = RunLog(make_config(tmp_path), tmp_path)
    assert run.summary_table() == ""
    run.eval(eval_report("init", 0, 0.125))
    for step in range(3):
        run.step(sft_row(step, 1.0))
    run.eval(eval_report("sft", 3, 0.25, pass_at_k=0.5))
    run.step(rl_row(1, 0.5))
    run.eval(eval_report("rl", 1, 0.375, spawn_rate=0.5))
    run.eval(eval_report("final", 4, 0.625, pass_at_k=0.875, children_per_root=2.25, tasks=7))
    run.close()
    lines = run.summary_table().splitlines()
    assert len(lines) == 2 + 4
    header, rule, *rows = lines
    for column in ("stage", "held-out reward", "pass@1", "spawn rate", "multi-paper spawn"):
        assert column in header
    assert header.split()[-2:] == ["children/root", "tasks"]
    assert [row.split("  ")[0].strip() for row in rows] == [
        "init",
        "after SFT",
        "RL step 1",
        "after RL",
    ]
    assert rows[0].split() == ["init", "0", "0.125", "-", "0.250", "0.750", "1.500", "12"]
    assert rows[1].split()[-6:] == ["0.250", "0.500", "0.250", "0.750", "1.500", "12"]
    assert rows[2].split()[-5:] == ["-", "0.500", "0.750", "1.500", "12"]
    assert rows[3].split()[-6:] == ["0.625", "0.875", "0.250", "0.750", "2.250", "7"]
    assert len({len(line) for line in lines}) == 1, "columns are not aligned"
    assert set(rule) == {"-", " "}


def test_summary_table_names_an_end_a_run_went_on_from_by_its_step(tmp_path):
    run = RunLog(make_config(tmp_path), tmp_path)
    run.eval(eval_report("sft", 3, 0.25))
    run.eval(eval_report("final", 5, 0.5))  # a finished run, then given more RL steps
    run.eval(eval_report("final", 7, 0.625))
    stages = [row.split("  ")[0].strip() for row in run.summary_table().splitlines()[2:]]
    assert stages == ["after SFT", "RL step 5", "after RL"]


def test_summary_table_names_the_reports_k(tmp_path):
    run = RunLog(make_config(tmp_path), tmp_path)
    run.eval(eval_report("final", 0, 0.5, pass_at_k=0.75, pass_k=4))
    assert "pass@4" in run.summary_table() and "pass@1" not in run.summary_table()


def test_summary_table_names_a_rows_own_k_where_it_differs(tmp_path):
    run = RunLog(make_config(tmp_path), tmp_path)
    run.eval(eval_report("init", 0, 0.0, pass_at_k=0.0, pass_k=1))
    run.eval(eval_report("final", 4, 0.5, pass_at_k=0.75, pass_k=8))
    header, _, init, final = run.summary_table().splitlines()
    assert "pass@8" in header and "pass@1" not in header
    assert init.split()[2:5] == ["0.000", "0.000", "@1"]
    assert final.split()[3:5] == ["0.500", "0.750"] and "@" not in final


def test_summary_table_gives_errors_and_the_gains_paired_by_task(tmp_path):
    run = RunLog(make_config(tmp_path), tmp_path)
    run.eval(eval_report("init", 0, 0.0, reward_stderr=0.0, task_rewards={"a": 0.0, "b": 0.0}))
    sft = {"a": 0.5, "b": 0.25, "c": 1.0}  # "c" was not scored at init: left out of that pair
    run.eval(eval_report("sft", 3, 0.625, reward_stderr=0.1875, task_rewards=sft))
    mid = {"a": 0.0, "b": 0.0, "c": 0.0}  # a mid-run point is no stage of its own
    run.eval(eval_report("rl", 2, 0.0, reward_stderr=0.0, task_rewards=mid))
    run.eval(
        eval_report(
            "final", 4, 0.75, reward_stderr=0.125, task_rewards={"a": 1.0, "b": 0.5, "c": 0.75}
        )
    )
    header, _, init, after_sft, _, after_rl, *gains = run.summary_table().splitlines()
    assert init.split()[2:5] == ["0.000", "±", "0.000"]
    assert after_sft.split()[3:6] == ["0.625", "±", "0.188"]  # "after SFT" is two words
    assert after_rl.split()[3:6] == ["0.750", "±", "0.125"]
    # init -> after SFT over a and b: differences 0.5 and 0.25, their mean 0.375, their sample
    # deviation 0.1768 over the root of two; after SFT -> after RL: 0.5, 0.25, -0.25.
    assert gains == [
        "init -> after SFT: +0.375 ± 0.125 (mean per-task difference over the 2 tasks both "
        "scored ± its standard error)",
        "after SFT -> after RL: +0.167 ± 0.220 (mean per-task difference over the 3 tasks "
        "both scored ± its standard error)",
    ]


def test_summary_table_pairs_no_report_without_per_task_rewards(tmp_path):
    run = RunLog(make_config(tmp_path), tmp_path)
    run.eval(eval_report("sft", 3, 0.5))  # an eval.jsonl written before reports kept them
    run.eval(eval_report("final", 4, 0.75, reward_stderr=0.125, task_rewards={"a": 1.0, "b": 0.5}))
    lines = run.summary_table().splitlines()
    assert len(lines) == 4 and lines[2].split()[3] == "0.500" and "±" not in lines[2]


def test_summary_table_without_pass_at_k_has_no_such_column(tmp_path):
    run = RunLog(make_config(tmp_path), tmp_path)
    run.eval(eval_report("init", 0, 0.5))
    assert "pass@" not in run.summary_table()


# ---------------------------------------------------------------- progress bar


def test_progress_bar_shows_phase_reward_and_throughput(tmp_path, capsys):
    with RunLog(make_config(tmp_path, progress=True), tmp_path) as run:
        run.step(sft_row(0, 1.0))
        shown = str(run._bar)  # tqdm rate-limits what it prints; this is the current line
        assert shown.startswith("sft:") and "1/7" in shown and "300 tok/s" in shown  # 600 / 2 s
        assert "reward" not in shown
        run.step({**rl_row(3, 0.625), "tokens": 0, "engine_tokens_per_s": 1234.0})
    err = capsys.readouterr().err
    assert "rl:" in err and "step 3" in err and "reward 0.625" in err and "1,234 tok/s" in err
    assert "7/7" in err  # RL step 3 of 4 after 3 SFT steps: the whole run


# ---------------------------------------------------------------- W&B


def test_wandb_project_without_wandb_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(runlog, "HAS_WANDB", False)
    cfg = make_config(tmp_path, wandb_project="rlm")
    with pytest.raises(ConfigError, match=r"^logging\.wandb_project: 'rlm' .*not installed"):
        RunLog(cfg, tmp_path)
    with pytest.raises(ConfigError, match="logging.wandb_project"):
        RunLog(cfg, tmp_path, rank0=False)  # every rank fails alike
    assert list(tmp_path.iterdir()) == []


def test_wandb_receives_config_scalars_and_finish(tmp_path, monkeypatch):
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    fake = types.SimpleNamespace(init=init, Histogram=lambda values: ("hist", len(values)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(runlog, "HAS_WANDB", True)
    with RunLog(make_config(tmp_path, wandb_project="rlm"), tmp_path) as run:
        run.eval(eval_report("init", 0, 0.1))
        run.step(rl_row(0, 0.5))
        run.histograms("rl", 0, advantage=[1.0, -1.0])
    (kwargs,) = calls["init"]
    assert kwargs["project"] == "rlm" and kwargs["mode"] == "offline"
    assert kwargs["config"]["train"]["sft_steps"] == 3
    steps = [step for step, _ in calls["log"]]
    assert steps == sorted(steps) == [0, 4, 4]
    assert calls["log"][0][1]["eval/reward_mean"] == 0.1
    assert calls["log"][1][1]["rl/finish_reasons/max_turns"] == 1.0
    assert calls["log"][2][1] == {"rl/advantage": ("hist", 2)}
    assert calls["finish"] == [True]


# ---------------------------------------------------------------- ranks


def test_rank0_false_writes_nothing(tmp_path, capsys):
    cfg = make_config(tmp_path / "run", progress=True, tensorboard=True, plot=True)
    with RunLog(cfg, tmp_path / "run", rank0=False) as run:
        run.eval(eval_report("init", 0, 0.1))
        run.step(sft_row(0, 1.0))
        run.histograms("sft", 0, entropy=[1.0])
        run.samples("sft", 0, [make_group("t0")], [[1.0, 0.0]])
        assert run.summary_table() == ""
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == ""
