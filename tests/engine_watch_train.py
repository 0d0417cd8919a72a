"""`rlmtrain train` that keeps what its engine served at the end: when the run closes the
engine, the weights the engine holds (under their Hugging Face names, in the engine's dtype) are
written to the safetensors file RLMTRAIN_TEST_ENGINE_WEIGHTS, so a test can compare them with
the run's final export (`tests/test_smollm2_rl_step.py`).

    python tests/engine_watch_train.py --config ... [--section.key=value ...]
"""

from __future__ import annotations

import os
import sys

from safetensors.torch import save_file

from rlmtrain.model import named_hf_tensors
from rlmtrain.training import startup


def _watched(build_engine, out: str):
    def build_and_watch(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        close = engine.close

        async def close_after_saving() -> None:
            tensors = {name: tensor.contiguous() for name, tensor in named_hf_tensors(engine.model)}
            save_file(tensors, out)
            await close()

        engine.close = close_after_saving
        return engine

    return build_and_watch


if __name__ == "__main__":
    startup.build_engine = _watched(
        startup.build_engine, os.environ["RLMTRAIN_TEST_ENGINE_WEIGHTS"]
    )
    from rlmtrain.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
