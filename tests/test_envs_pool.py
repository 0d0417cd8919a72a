"""The PDF pools' workers: a caller's gloo process group, left as garbage, is not theirs to free
(in a fork of the caller, freeing it joins threads the child does not have), and a script that
starts a pool needs no main guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

_CALLER = textwrap.dedent(
    """
    import gc, os, sys
    from pathlib import Path

    import torch.distributed as dist

    from rlmtrain.envs.pdf import ingest_files
    from rlmtrain.envs.synth import synthesize

    if __name__ == "__main__":
        out, pool = Path(sys.argv[1]), sys.argv[2]
        # A gloo group with its threads, in a reference cycle no collection here will free, as
        # a test or a rank that left its process group can leave one.
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        cycle = [group, None]
        cycle[1] = cycle
        gc.disable()
        del group, cycle
        # Any child forked from this process collects its garbage as it starts.
        os.register_at_fork(after_in_child=lambda: (gc.enable(), gc.collect()))
        summary = synthesize(out, groups=2, seed=0, workers=2 if pool == "synth" else 1)
        if pool == "ingest":
            papers, skipped = ingest_files(sorted((out / "pdfs").glob("*.pdf")), workers=2)
            assert len(papers) == summary.papers and not skipped, (papers, skipped)
        print("papers", summary.papers)
    """
)


@pytest.mark.parametrize("pool", ["synth", "ingest"])
def test_a_pool_never_frees_its_callers_garbage(tmp_path, pool):
    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    caller = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "data"), pool],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = caller.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(caller.pid, signal.SIGKILL)  # the caller and the pool's hung workers
        caller.communicate()
        pytest.fail(f"the {pool} pool hung on its caller's garbage")
    assert caller.returncode == 0, err[-2000:]
    assert out.startswith("papers "), out


def test_a_script_without_a_main_guard_can_use_the_pool(tmp_path):
    # Workers that start a fresh interpreter import the caller's main module again, and this
    # one would start its pool again from each of them.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        "from rlmtrain.envs.synth import synthesize\n"
        "print('papers', synthesize(sys.argv[1], groups=2, seed=0, workers=2).papers)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("papers "), done.stdout
