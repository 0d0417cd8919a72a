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
from rlmtrain.model.hf import (
    CheckpointError,
    RowReader,
    load_hf,
    load_hf_tensors,
    named_hf_tensors,
    read_hf_args,
    save_hf,
)
from rlmtrain.model.kv_cache import CacheFull, KVCache, kv_cache_bytes
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
    "RowReader",
    "Transformer",
    "build_model",
    "kv_cache_bytes",
    "load_hf",
    "load_hf_tensors",
    "model_skeleton",
    "named_hf_tensors",
    "preset",
    "save_hf",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(cfg: ModelConfig) -> Transformer:
    """The model `cfg` describes, on the CPU: loaded from `cfg.hf_dir`, else `cfg.preset` with
    random weights from `cfg.seed`; in `cfg.dtype`, with its attention and checkpointing."""
    dtype = _DTYPES[cfg.dtype]
    if cfg.hf_dir:
        return load_hf(cfg.hf_dir, dtype=dtype, **_options(cfg))
    # Built on the meta device and materialised once: a default nn.Linear init of an 8B model
    # would cost minutes before being overwritten.
    model = model_skeleton(cfg).to_empty(device="cpu")
    model.init_weights(cfg.seed)
    return model.to(dtype)


def model_skeleton(cfg: ModelConfig) -> Transformer:
    """The model `cfg` describes on the meta device: its shape (`hf_dir`'s config.json, else the
    preset with `vocab_size`), no storage and no values."""
    if cfg.hf_dir:
        args = read_hf_args(cfg.hf_dir)
    else:
        args = preset(cfg.preset)
        if cfg.vocab_size:
            args = msgspec.structs.replace(args, vocab_size=cfg.vocab_size)
    with torch.device("meta"):
        return Transformer(args, **_options(cfg))


def _options(cfg: ModelConfig) -> dict[str, object]:
    return {
        "attention": cfg.attention,
        "activation_checkpointing": cfg.activation_checkpointing,
        "compile_layers": cfg.compile_layers,
    }
