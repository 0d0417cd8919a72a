"""The policy model: a Qwen3 / Llama-3 decoder over packed tokens, its KV cache, HF checkpoints.

`build_model(cfg)` is the entry point for the trainer and the engines; the submodules hold one
concept each (`presets`, `attention`, `transformer`, `kv_cache`, `hf`). The tokenizer lives in
`tokenizer.py` and is imported from there.
"""

from __future__ import annotations

import msgspec
import torch

from rlmtrain.config import ModelConfig
from rlmtrain.model.attention import AttentionChoice
from rlmtrain.model.hf import CheckpointError, load_hf, load_hf_tensors, named_hf_tensors, save_hf
from rlmtrain.model.kv_cache import CacheFull, KVCache
from rlmtrain.model.presets import PRESETS, ModelArgs, RopeScaling, preset
from rlmtrain.model.transformer import Transformer

__all__ = [
    "PRESETS",
    "AttentionChoice",
    "CacheFull",
    "CheckpointError",
    "KVCache",
    "ModelArgs",
    "RopeScaling",
    "Transformer",
    "build_model",
    "load_hf",
    "load_hf_tensors",
    "named_hf_tensors",
    "preset",
    "save_hf",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(cfg: ModelConfig) -> Transformer:
    """The model `cfg` describes, on the CPU: loaded from `cfg.hf_dir`, else `cfg.preset` with
    random weights from `cfg.seed`; in `cfg.dtype`, with its attention and checkpointing."""
    dtype = _DTYPES[cfg.dtype]
    options = {"attention": cfg.attention, "activation_checkpointing": cfg.activation_checkpointing}
    if cfg.hf_dir:
        return load_hf(cfg.hf_dir, dtype=dtype, **options)
    # Built on the meta device and materialised once: a default nn.Linear init of an 8B model
    # would cost minutes before being overwritten.
    args = preset(cfg.preset)
    if cfg.vocab_size:
        args = msgspec.structs.replace(args, vocab_size=cfg.vocab_size)
    with torch.device("meta"):
        model = Transformer(args, **options)
    model = model.to_empty(device="cpu")
    model.init_weights(cfg.seed)
    return model.to(dtype)
