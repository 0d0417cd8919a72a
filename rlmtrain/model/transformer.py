"""Decoder-only transformer of the Qwen3 and Llama-3 families over packed tokens.

One stack serves both families: pre-norm blocks of grouped-query attention with RoPE and a SwiGLU
MLP; Qwen3 adds an RMSNorm over each head of q and k before RoPE (`qk_norm`), Llama-3 may scale
RoPE frequencies ("llama3" rope_scaling). Submodule names are those of Hugging Face's
`model.*` tree, so `hf.py` maps names by prefix, never by table.

The forward takes packed rows (`input_ids[T]`, `position_ids[T]`, `cu_seqlens[R+1]`, and
`prefix_of[R]` where rows continue a shared prefix row) and returns the final-normed hidden
states `[T, H]`; the LM head is left to the caller, because the
fused log-prob kernels multiply by `lm_head_weight` chunk by chunk and never hold `[T, V]`.
Layers reach attention only through an `attend(layer, q, k, v)` callable, so the training forward
(`attention.PackedAttention`) and the KV-cache paths (`kv_cache.py`) run the same weights and the
same arithmetic.

RoPE tables are computed per call in fp32 from `ModelArgs` (not kept as buffers, which `.to(bf16)`
would round) and cast to the activation dtype, as Hugging Face does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlmtrain.model.attention import check_choice, plan_attention
from rlmtrain.model.presets import ModelArgs

__all__ = ["Attend", "Transformer", "attention_inputs", "attention_output", "rope_cos_sin"]

Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""attend(layer_index, q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D]) -> [T, Hq, D]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the input dtype: the order Hugging Face uses, so bf16
        # activations round the same way in both.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(args: ModelArgs, device: torch.device) -> Tensor:
    """Per-pair rotation frequencies `[D/2]` fp32, with Llama-3 scaling applied when configured."""
    exponents = (
        torch.arange(0, args.head_dim, 2, device=device, dtype=torch.float32) / args.head_dim
    )
    inv_freq = 1.0 / (args.rope_theta**exponents)
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, interpolated, scaled)


def rope_cos_sin(
    args: ModelArgs, position_ids: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin `[T, 1, D]` for `position_ids[T]`, halves duplicated (rotate-half layout)."""
    freqs = position_ids.float()[:, None] * rope_inv_freq(args, position_ids.device)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = SelfAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, attend: Callable[..., Tensor], compiled: bool
    ) -> Tensor:
        if not compiled:
            q, k, v = attention_inputs(self, h, cos, sin)
            return attention_output(self, h, attend(q, k, v))
        before, after = _compiled_regions()
        q, k, v = before(self, *_any_token_count(h, cos, sin))
        return after(self, *_any_token_count(h, attend(q, k, v)))


def attention_inputs(
    layer: DecoderLayer, h: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's work before attention on `h[T, H]`: the input norm, the q/k/v projections, the
    q/k norms and RoPE (`cos`, `sin` `[T, 1, D]`). Returns q `[T, Hq, D]`, k and v `[T, Hkv, D]`."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    t = x.shape[0]
    q = attn.q_proj(x).view(t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v


def attention_output(layer: DecoderLayer, h: Tensor, out: Tensor) -> Tensor:
    """A layer's work after attention, from its input `h[T, H]` and attention's `out[T, Hq, D]`:
    the output projection and residual, then the MLP block. Returns `[T, H]`."""
    h = h + layer.self_attn.o_proj(out.reshape(h.shape[0], -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _any_token_count(*tensors: Tensor) -> tuple[Tensor, ...]:
    """`tensors`, their first dimension (the tokens) marked dynamic: the count differs with every
    packed batch, and a region compiled for the first count would compile again for the second."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return tensors


@functools.cache
def _compiled_regions() -> tuple[
    Callable[..., tuple[Tensor, Tensor, Tensor]], Callable[..., Tensor]
]:
    # One compiled function per region, the layer passed in: every layer has the same code and
    # parameter shapes, so the graph compiled for the first serves all of them (one graph per
    # region and grad mode, the token count dynamic). Attention stays out of these graphs: its
    # backends bring their own kernels, and its per-batch plan would be a guard.
    return torch.compile(attention_inputs), torch.compile(attention_output)


class Transformer(nn.Module):
    """Qwen3 / Llama-3 decoder. `forward` maps packed tokens to final-normed hidden states.

    attention: "auto" | "flash" | "flex" | "sdpa" (see `attention.py`).
    activation_checkpointing: recompute each layer in backward (non-reentrant checkpoint).
    compile_layers: `forward` runs each layer's work around attention as two `torch.compile`d
    regions (`attention_inputs`, `attention_output`), fusing the norms, RoPE, SwiGLU and residual
    adds; attention stays outside them, and the KV-cache paths (`hidden_states` called
    directly) run eager.
    """

    def __init__(
        self,
        args: ModelArgs,
        *,
        attention: str = "auto",
        activation_checkpointing: bool = False,
        compile_layers: bool = False,
    ):
        super().__init__()
        check_choice(attention)
        self.args = args
        self.attention = attention
        self.activation_checkpointing = activation_checkpointing
        self.compile_layers = compile_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (
            None
            if args.tie_word_embeddings
            else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        )

    @property
    def lm_head_weight(self) -> Tensor:
        """`[V, H]`: the LM head, or the input embedding when the two are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random init from `seed` alone: normal(0, std) matrices, unit norm scales."""
        params = dict(self.named_parameters())
        for name, values in self.initial_values(seed, std):
            params[name].copy_(values)

    def initial_values(self, seed: int, std: float = 0.02) -> Iterator[tuple[str, Tensor]]:
        """(name, whole fp32 value) of every parameter as `init_weights` sets it, one at a time
        in the module's order: what a sharded model takes its own rows from, holding one whole
        parameter at a time instead of the model."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                yield name, torch.ones(param.shape, dtype=torch.float32)
            else:
                yield name, torch.randn(param.shape, generator=gen, dtype=torch.float32) * std

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        cu_seqlens: Tensor,
        prefix_of: Tensor | None = None,
    ) -> Tensor:
        """input_ids, position_ids: `[T]` int; cu_seqlens: `[R+1]` int, 0 .. T; prefix_of: `[R]`
        int, the row each row continues or -1 (`attention.py`). Returns `[T, H]`."""
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"expected packed 1-D input_ids and position_ids of one shape, got "
                f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}"
            )
        attend = plan_attention(
            self.attention,
            cu_seqlens.to(input_ids.device),
            input_ids.numel(),
            self.embed_tokens.weight.dtype,
            prefix_of,
        )
        return self.hidden_states(
            input_ids,
            position_ids,
            lambda _layer, q, k, v: attend(q, k, v),
            compiled=self.compile_layers,
        )

    def hidden_states(
        self, input_ids: Tensor, position_ids: Tensor, attend: Attend, *, compiled: bool = False
    ) -> Tensor:
        """The layer stack with attention supplied by the caller (see `Attend`); `[T, H]`.
        compiled: run the layers' compiled regions (see `compile_layers`)."""
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.args, position_ids, h.dtype)
        for index, layer in enumerate(self.layers):
            layer_attend = _bind_layer(attend, index)
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, layer_attend, compiled, use_reentrant=False)
            else:
                h = layer(h, cos, sin, layer_attend, compiled)
        return self.norm(h)


def _bind_layer(attend: Attend, index: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    return lambda q, k, v: attend(index, q, k, v)
