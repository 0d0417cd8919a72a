"""Paged KV cache with a fixed token capacity, and the prefill and decode steps over it.

Layout: the capacity is cut into pages of `page_size` token slots. Per layer there is one key and
one value tensor `[num_pages * page_size, Hkv, D]`. A sequence owns a list of pages, its page
table; its token i lives in slot `pages[i // page_size] * page_size + i % page_size`. Admitting a
sequence takes pages for its prompt, decoding takes one more page each time a sequence crosses a
page boundary, evicting returns all its pages to the free list. Pages rather than one contiguous
range per sequence so that any freed capacity serves any later sequence without compaction (the
PagedAttention layout, Kwon et al. 2023); the cost is one gather per layer at decode time.

Steps (both under `torch.no_grad`; a loop over layers, none over tokens or sequences):
- `prefill` runs several new prompts as one packed batch through the training attention backend
  (each prompt attends only to itself: admission never shares a prefix) and scatters their keys
  and values into the slots.
- `decode` takes one token per sequence, writes its key and value into its slot, gathers every
  sequence's keys through a padded slot table `[B, S_max]` and runs one batched SDPA per layer with
  a length mask, so sequences of different lengths decode together.

Running out of pages raises `CacheFull` before anything changes; the caller evicts and retries.
The continuous-batching policy (who to admit, whom to evict) belongs to the engine, not here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from rlmtrain.model.attention import plan_attention
from rlmtrain.model.presets import ModelArgs

if TYPE_CHECKING:
    from rlmtrain.model.transformer import Transformer

__all__ = ["CacheFull", "KVCache", "decode", "prefill"]


class CacheFull(RuntimeError):
    """Not enough free pages for the requested tokens; evict sequences first."""


class KVCache:
    """Keys and values of up to `capacity_tokens` tokens, in pages of `page_size` slots."""

    def __init__(
        self,
        args: ModelArgs,
        capacity_tokens: int,
        *,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if capacity_tokens < page_size or page_size < 1:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} must be >= page_size={page_size} >= 1"
            )
        self.page_size = page_size
        self.num_pages = capacity_tokens // page_size
        shape = (args.num_layers, self.num_pages * page_size, args.num_kv_heads, args.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # A stack: pop() hands out the lowest free page, evict() pushes pages back on top.
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @classmethod
    def for_model(cls, model: Transformer, capacity_tokens: int, *, page_size: int = 16) -> KVCache:
        """A cache in the model's dtype and on its device."""
        weight = model.embed_tokens.weight
        return cls(
            model.args,
            capacity_tokens,
            page_size=page_size,
            dtype=weight.dtype,
            device=weight.device,
        )

    @property
    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits in the free pages now."""
        return math.ceil(num_tokens / self.page_size) <= len(self._free_pages)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._pages

    def length(self, seq_id: int) -> int:
        """Tokens cached for `seq_id`."""
        return self._lengths[self._known(seq_id)]

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """The page table of `seq_id`, in token order."""
        return tuple(self._pages[self._known(seq_id)])

    def evict(self, seq_id: int) -> None:
        """Forget `seq_id` and return its pages to the free list."""
        self._free_pages.extend(reversed(self._pages.pop(self._known(seq_id))))
        del self._lengths[seq_id]

    def _known(self, seq_id: int) -> int:
        if seq_id not in self._pages:
            raise KeyError(f"sequence {seq_id} is not in the KV cache")
        return seq_id

    def _admit(self, seq_ids: list[int], lengths: list[int]) -> Tensor:
        """Reserve pages for new sequences; their slots, concatenated in order, `[sum(lengths)]`."""
        for seq_id in seq_ids:
            if seq_id in self._pages or seq_ids.count(seq_id) > 1:
                raise ValueError(f"sequence {seq_id} is already in the KV cache")
        needed = sum(math.ceil(n / self.page_size) for n in lengths)
        if needed > len(self._free_pages):
            raise CacheFull(
                f"admitting {len(seq_ids)} sequences needs {needed} pages, "
                f"{len(self._free_pages)} are free"
            )
        for seq_id, n in zip(seq_ids, lengths, strict=True):
            self._pages[seq_id] = [
                self._free_pages.pop() for _ in range(math.ceil(n / self.page_size))
            ]
            self._lengths[seq_id] = n
        return torch.cat(
            [self._slots(seq_id, 0, n) for seq_id, n in zip(seq_ids, lengths, strict=True)]
        )

    def _append_one(self, seq_ids: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Grow each sequence by one token: (positions [B], new slots [B], lengths after [B])."""
        for seq_id in seq_ids:
            self._known(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in one decode step: {seq_ids}")
        growing = [s for s in seq_ids if self._lengths[s] == len(self._pages[s]) * self.page_size]
        if len(growing) > len(self._free_pages):
            raise CacheFull(
                f"decode step needs {len(growing)} new pages, {len(self._free_pages)} are free"
            )
        for seq_id in growing:
            self._pages[seq_id].append(self._free_pages.pop())
        positions = [self._lengths[s] for s in seq_ids]
        slots = [
            self._pages[s][p // self.page_size] * self.page_size + p % self.page_size
            for s, p in zip(seq_ids, positions, strict=True)
        ]
        for seq_id in seq_ids:
            self._lengths[seq_id] += 1
        device = self.keys.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)
        return as_tensor(positions), as_tensor(slots), as_tensor([p + 1 for p in positions])

    def _slot_table(self, seq_ids: list[int]) -> Tensor:
        """`[B, P_max * page_size]` slots of each sequence's pages; padding points at slot 0."""
        widest = max(len(self._pages[s]) for s in seq_ids)
        table = torch.zeros(len(seq_ids), widest, dtype=torch.long)
        for row, seq_id in enumerate(seq_ids):
            pages = self._pages[seq_id]
            table[row, : len(pages)] = torch.tensor(pages)
        offsets = torch.arange(self.page_size)
        return (table[:, :, None] * self.page_size + offsets).flatten(1).to(self.keys.device)

    def _slots(self, seq_id: int, start: int, end: int) -> Tensor:
        positions = torch.arange(start, end)
        pages = torch.tensor(self._pages[seq_id], dtype=torch.long)
        slots = pages[positions // self.page_size] * self.page_size + positions % self.page_size
        return slots.to(self.keys.device)


@torch.no_grad()
def prefill(
    model: Transformer, cache: KVCache, seq_ids: list[int], prompts: list[Tensor]
) -> Tensor:
    """Admit `prompts` (1-D token tensors of any lengths) as `seq_ids`; last hidden `[B, H]`."""
    if len(seq_ids) != len(prompts) or not prompts:
        raise ValueError(
            f"prefill needs one seq_id per prompt, got {len(seq_ids)} ids, {len(prompts)} prompts"
        )
    lengths = [p.numel() for p in prompts]
    if min(lengths) < 1 or any(p.dim() != 1 for p in prompts):
        raise ValueError(
            f"prompts must be non-empty 1-D token tensors, "
            f"got shapes {[tuple(p.shape) for p in prompts]}"
        )
    device = cache.keys.device
    slots = cache._admit(seq_ids, lengths)
    input_ids = torch.cat(prompts).to(device)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0)
    packed = plan_attention(model.attention, cu_seqlens, input_ids.numel(), cache.keys.dtype)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.keys[layer].index_copy_(0, slots, k)
        cache.values[layer].index_copy_(0, slots, v)
        return packed(q, k, v)

    hidden = model.hidden_states(input_ids, position_ids, attend)
    return hidden[cu_seqlens[1:] - 1]


@torch.no_grad()
def decode(model: Transformer, cache: KVCache, seq_ids: list[int], tokens: Tensor) -> Tensor:
    """Feed `tokens[B]`, one per cached sequence in `seq_ids`; hidden `[B, H]` at those tokens."""
    if tokens.dim() != 1 or tokens.numel() != len(seq_ids) or not seq_ids:
        raise ValueError(
            f"decode needs one token per seq_id, "
            f"got tokens {tuple(tokens.shape)} for {len(seq_ids)} ids"
        )
    positions, slots, lengths = cache._append_one(seq_ids)
    table = cache._slot_table(seq_ids)
    visible = (torch.arange(table.shape[1], device=table.device)[None, :] < lengths[:, None])[
        :, None, None, :
    ]

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.keys[layer].index_copy_(0, slots, k)
        cache.values[layer].index_copy_(0, slots, v)
        keys = cache.keys[layer][table].transpose(1, 2)  # [B, Hkv, S, D]
        values = cache.values[layer][table].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], keys, values, attn_mask=visible, enable_gqa=True
        )
        return out[:, :, 0, :]

    return model.hidden_states(tokens.to(cache.keys.device), positions, attend)
