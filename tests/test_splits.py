"""The run's three task sets: disjoint groups, made once, remade when the data settings change."""

import msgspec

from rlmtrain.config import Config, JudgeConfig
from rlmtrain.envs.base import get_env


def _config(tmp_path, **data) -> Config:
    cfg = Config()
    fields = {"sft_groups": 2, "synth_groups": 2, "eval_groups": 1, "synth_max_papers": 3, **data}
    return msgspec.structs.replace(
        cfg,
        data=msgspec.structs.replace(cfg.data, **fields),
        checkpoint=msgspec.structs.replace(cfg.checkpoint, dir=str(tmp_path)),
        logging=msgspec.structs.replace(cfg.logging, progress=False),
    )


def test_splits_are_disjoint_and_made_once(tmp_path):
    cfg = _config(tmp_path)
    env = get_env("evidence", cfg)
    splits = {name: env.split_tasks(cfg, name) for name in ("sft", "rl", "eval")}
    papers = {name: {p for t in tasks for p in t.paper_ids} for name, tasks in splits.items()}
    groups = {name: {t.id.split("-")[0] for t in tasks} for name, tasks in splits.items()}
    assert all(splits.values())
    assert not papers["sft"] & papers["rl"] and not papers["rl"] & papers["eval"]
    assert not papers["sft"] & papers["eval"]
    assert groups["sft"] <= {"g0000", "g0001"} and groups["eval"] == {"g0004"}
    assert all(len(t.paper_ids) <= 3 for tasks in splits.values() for t in tasks)
    made = (tmp_path / "data" / "rl" / "tasks.jsonl").stat().st_mtime_ns
    env.split_tasks(cfg, "rl")
    assert (tmp_path / "data" / "rl" / "tasks.jsonl").stat().st_mtime_ns == made
    more = _config(tmp_path, synth_groups=3)
    assert len({t.id.split("-")[0] for t in env.split_tasks(more, "rl")}) == 3


def test_a_task_file_wins_and_sft_falls_back_to_it(tmp_path):
    cfg = _config(tmp_path)
    env = get_env("evidence", cfg)
    rl = env.split_tasks(cfg, "rl")
    path = tmp_path / "data" / "rl" / "tasks.jsonl"
    named = msgspec.structs.replace(
        cfg, data=msgspec.structs.replace(cfg.data, train_path=str(path))
    )
    assert [t.id for t in env.split_tasks(named, "sft")] == [t.id for t in rl]


def _contents(tasks) -> list:
    return [msgspec.structs.replace(t, codebase="") for t in tasks]


def test_codenav_splits_ask_about_code_of_their_own_made_the_same_each_time(tmp_path):
    cfg = _config(tmp_path / "a", env="codenav")
    env = get_env("codenav", cfg)
    splits = {name: env.split_tasks(cfg, name) for name in ("sft", "rl", "eval")}
    bases = {name: {t.codebase for t in tasks} for name, tasks in splits.items()}
    assert [len(b) for b in bases.values()] == [2, 2, 1]
    paths = {name: {t.caller_path.split("/")[0] for t in tasks} for name, tasks in splits.items()}
    assert not paths["sft"] & paths["rl"] and not paths["rl"] & paths["eval"]
    assert not paths["sft"] & paths["eval"]
    queries = [t.query for tasks in splits.values() for t in tasks]
    assert len(set(queries)) == len(queries)
    again = _config(tmp_path / "b", env="codenav")
    assert _contents(env.split_tasks(again, "eval")) == _contents(splits["eval"])
    other = _config(tmp_path / "c", env="codenav", seed=1)
    assert _contents(env.split_tasks(other, "eval")) != _contents(splits["eval"])


def test_booknav_splits_hold_distinct_problems_made_the_same_each_time(tmp_path):
    cfg = _config(tmp_path / "a", env="booknav")
    cfg = msgspec.structs.replace(cfg, judge=JudgeConfig(base_url="http://127.0.0.1:9/v1"))
    env = get_env("booknav", cfg)
    splits = {name: env.split_tasks(cfg, name) for name in ("sft", "rl", "eval")}
    assert [len(tasks) for tasks in splits.values()] == [2, 2, 1]
    queries = [t.query for tasks in splits.values() for t in tasks]
    assert len(set(queries)) == len(queries)
    again = msgspec.structs.replace(
        cfg, checkpoint=msgspec.structs.replace(cfg.checkpoint, dir=str(tmp_path / "b"))
    )
    assert [t.query for t in env.split_tasks(again, "rl")] == [t.query for t in splits["rl"]]
