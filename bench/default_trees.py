"""The default's tree shapes, for the benches that simulate its rollouts (`bench_async.py`).

`data/default_trees.json` holds, for each tree of a rollout of the default's trained policy
(configs/tiny-cpu.toml after `rlmtrain train`, 24 training tasks x 8 roots), each trajectory's
turns as [completion tokens, REPL output characters], the turn whose code called rlm_query and
its children, recursively; and `repl_s`, the seconds of every REPL exec of that rollout less the
time its rlm_query calls waited (the REPL's own share of a turn). Made with

    python bench/default_trees.py RUN_DIR OUT.json

from a rollout of the run's final policy written by this module's `record` (the `rlmtrain
rollout` command with each exec timed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "default_trees.json"


def load() -> tuple[list[dict[str, Any]], list[float]]:
    """(trees, REPL seconds per exec) as recorded."""
    data = json.loads(DATA.read_text())
    return data["trees"], data["repl_s"]


def shape(trajectory, by_id) -> dict[str, Any]:
    spawn = next((i for i, turn in enumerate(trajectory.turns) if "rlm_query" in turn.code), -1)
    return {
        "turns": [[len(t.completion_ids), len(t.output)] for t in trajectory.turns],
        "spawn": spawn if trajectory.children else -1,
        "children": [shape(by_id[c], by_id) for c in trajectory.children],
    }


def record(run_dir: Path, out: Path, tasks: int = 24) -> None:
    """Roll out the run's final policy with every REPL exec timed; write the shapes to `out`."""
    import rlmtrain.rlm.repl as repl
    from rlmtrain.cli import main
    from rlmtrain.rlm.records import read_groups

    times: list[float] = []
    original = repl.Session.exec

    async def timed(self, code, on_query=None):
        waited = 0.0

        async def handler(*args, **kwargs):
            nonlocal waited
            began = time.perf_counter()
            try:
                return await on_query(*args, **kwargs)
            finally:
                waited += time.perf_counter() - began

        began = time.perf_counter()
        try:
            return await original(self, code, handler if on_query else None)
        finally:
            times.append(time.perf_counter() - began - waited)

    repl.Session.exec = timed
    groups_file = out.with_suffix(".groups.jsonl")
    main([
        "rollout", "--config", "configs/tiny-cpu.toml", "--out", str(groups_file),
        f"--limit={tasks}", f"--model.hf_dir={run_dir / 'final'}", "--model.tokenizer=",
        f"--checkpoint.dir={run_dir}",
    ])  # fmt: skip
    trees = []
    for group in read_groups(groups_file):
        by_id = group.by_id()
        trees += [shape(root, by_id) for root in group.roots]
    out.write_text(json.dumps({"trees": trees, "repl_s": [round(t, 5) for t in times]}))


if __name__ == "__main__":
    record(Path(sys.argv[1]), Path(sys.argv[2]))
