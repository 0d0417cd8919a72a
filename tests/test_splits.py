"""The run's three task sets: disjoint groups, made once, remade when the data settings change."""

import msgspec

from rlmtrain.config import Config
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
