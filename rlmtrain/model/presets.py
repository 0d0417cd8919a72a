"""Model shapes: `ModelArgs` and the named presets.

`ModelArgs` describes one decoder of the Qwen3 or Llama-3 family in our own field names; `hf.py`
translates it to and from a Hugging Face `config.json`. The Qwen3 presets copy the public configs'
shapes (weights are random: they exist for benchmarks and engine tests, not for quality). `tiny`
is Qwen3-shaped and small enough to train on a CPU; its vocabulary of 384 holds the byte
tokenizer (256 bytes plus special tokens, rounded up).
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["PRESETS", "ModelArgs", "RopeScaling", "preset"]


class RopeScaling(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Llama-3 ("llama3") RoPE frequency scaling: long wavelengths are slowed by `factor`,
    short ones kept, the band between interpolated (Llama 3.1 report, section 3.3)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


class ModelArgs(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Shape of a decoder-only transformer; every field maps to one `config.json` key."""

    family: Literal["qwen3", "llama"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 40960

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelArgs.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs.head_dim={self.head_dim} must be even for RoPE")

    def num_params(self) -> int:
        """Parameter count (the tied LM head counted once)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * (attn + mlp + norms) + embed + head + self.hidden_size


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> ModelArgs:
    return ModelArgs(
        family="qwen3",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        qk_norm=True,
        max_position_embeddings=40960,
    )


PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        family="qwen3",
        vocab_size=384,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        qk_norm=True,
        max_position_embeddings=16384,
    ),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
}


def preset(name: str) -> ModelArgs:
    """The `ModelArgs` of a named preset; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
