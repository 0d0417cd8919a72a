"""`python -m rlmtrain train` with every REPL exec delayed by a random few milliseconds, drawn
from a generator of its own seeded by RLMTRAIN_TEST_JITTER_SEED: asynchronous requests then
reach the engine in another order and other company than in an unperturbed run, which is what
the determinism tests need (`tests/test_resume.py`). Runs under torchrun too.

With RLMTRAIN_TEST_HOLD_AT=<checkpoint name> (e.g. sft-000008) the run stops for good when it
comes to write that checkpoint, so a test that kills it after an earlier one kills it before
this one however late the kill comes.

With RLMTRAIN_TEST_FAIL_ROLLOUT_AT=<step> an inference rank (`rollout.inference_ranks`) raises
when it comes to take that RL step's rollout, as a rank whose engine failed would.

    python tests/perturbed_train.py --config ... [--section.key=value ...]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading

from rlmtrain import checkpointing
from rlmtrain.rlm import repl


def _jittered(exec_, draw):
    async def exec_with_delay(self, code, on_query=None):
        await asyncio.sleep(draw.uniform(0.0, 0.03))
        result = await exec_(self, code, on_query)
        await asyncio.sleep(draw.uniform(0.0, 0.03))
        return result

    return exec_with_delay


def _failing_at(take, failing_step):
    async def take_or_fail(self, step):
        if step == failing_step:
            raise RuntimeError(f"test: the inference rank fails at step {step}")
        return await take(self, step)

    return take_or_fail


def _holding(save, name):
    def save_or_hold(run_dir, model, optimizer, state, **kwargs):
        if f"{state.phase}-{state.step:06d}" == name:
            threading.Event().wait()  # until the test's SIGKILL
        return save(run_dir, model, optimizer, state, **kwargs)

    return save_or_hold


if __name__ == "__main__":
    seed = int(os.environ.get("RLMTRAIN_TEST_JITTER_SEED", "1"))
    draw = random.Random(seed * 7919 + int(os.environ.get("RANK", "0")))
    repl.Session.exec = _jittered(repl.Session.exec, draw)
    if "RLMTRAIN_TEST_HOLD_AT" in os.environ:
        checkpointing.save = _holding(checkpointing.save, os.environ["RLMTRAIN_TEST_HOLD_AT"])
    if "RLMTRAIN_TEST_FAIL_ROLLOUT_AT" in os.environ:
        from rlmtrain.rollout.ahead import Ahead

        Ahead.take = _failing_at(Ahead.take, int(os.environ["RLMTRAIN_TEST_FAIL_ROLLOUT_AT"]))
    from rlmtrain.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
