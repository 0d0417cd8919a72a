"""Paged KV cache with automatic prefix caching, and the prefill and decode steps over it.

Layout: the capacity is cut into pages of `page_size` token slots. Per layer there is one key and
one value tensor `[Hkv, num_pages * page_size, D]`. A sequence holds a list of pages, its page
table; its token i lives in slot `pages[i // page_size] * page_size + i % page_size`. Pages
rather than one contiguous range per sequence so that any freed capacity serves any later
sequence without compaction (the PagedAttention layout, Kwon et al. 2023); the cost is one gather
per layer at attention time.

Prefix caching, the scheme of vLLM's automatic prefix caching. Every turn of every trajectory
starts with the same system prompt (about 5.5k byte tokens for the evidence env) and repeats the
trajectory's history, so most prompt tokens were computed before. A full page is named by a
digest that chains its parent page's digest with its own token ids: equal digests mean equal
whole prefixes, hence equal keys and values (the chain is a 128-bit BLAKE2b, not Python's
`hash`: a collision would silently share wrong keys). Pages are reference-counted. Admitting a
prompt shares its leading pages whose digests are cached and prefills only the rest; the last
prompt token is always computed, since its hidden state gives the first sampled token. Prompts
later in one `prefill` share the full pages an earlier prompt of the same batch computes.

What keeps sharing safe: only full pages are shared, and a page is registered under its digest
only once its keys and values are written (after the prefill or decode step that filled it), so
a sequence writes only into pages it holds alone and nothing needs copy-on-write. Evicting a
sequence drops its references; a page nobody references keeps its content and digest on an LRU
list and is recycled (its digest forgotten) only when a page is needed and no unused page is
left, so a prefix outlives its sequences until memory runs short. Both kinds of unreferenced page
are free capacity (`free_pages`). `plan()` tells, without changing anything, which pages a batch
of prompts would share and how many free pages it takes (new pages, plus cached ones it revives
from the LRU list). `reset_prefix_cache()` forgets every digest: after a weight update the cached
keys and values belong to the old weights.

Steps (both under `torch.no_grad`; a loop over layers). Each layer first writes every new key and
value into its slot, then attends through the page tables, so a prompt may read pages another
prompt of the batch has just written.
- `prefill` runs the uncached suffixes of several new prompts as one packed batch, each query at
  its true position.
- `decode` takes one token per sequence.
Both attend by `paged_attention.PagedQueries`: keys in fixed-position chunks, and the query rows
that read the same pages of a chunk (a prompt's rows, or sequences behind a shared system prompt
and history) in one product that reads those keys once. A row's hidden state is then the same
bits whichever rows share its step and wherever its cached keys came from, which is what lets
a run reproduce the engine's log-probs exactly.
Gathers copy whole pages into one reused workspace (see `gather`).

Running out of pages raises `CacheFull` before anything changes; the caller evicts and retries.
The continuous-batching policy (who to admit, whom to evict) belongs to the engine, not here.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from rlmtrain.model.paged_attention import PagedQueries, QuerySpan, linear_min_rows
from rlmtrain.model.presets import ModelArgs

if TYPE_CHECKING:
    from rlmtrain.model.transformer import Transformer

__all__ = ["AdmissionPlan", "CacheFull", "KVCache", "decode", "kv_cache_bytes", "prefill"]

_ROOT = b""
"""The parent digest of a sequence's first page."""

DEFAULT_CHUNK_TOKENS = 256
"""Attention chunk of a cache that names none, rounded down to whole pages (at least one)."""


class CacheFull(RuntimeError):
    """Not enough free pages for the requested tokens; evict sequences first."""


def _digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class _Sequence:
    __slots__ = ("cached", "length", "pages", "parent", "tail")

    def __init__(self, pages: list[int], length: int, cached: int, parent: bytes | None):
        self.pages = pages
        self.length = length
        self.cached = cached
        """Leading prompt tokens shared from the prefix cache at admission."""
        self.parent = parent
        """Digest of the last full page; None when this sequence registers no pages."""
        self.tail: list[int] = []
        """Token ids after the last full page (tracked only while `parent` is not None)."""


class _Planned:
    __slots__ = ("digests", "new_pages", "shared")

    def __init__(self, digests: list[bytes]):
        self.digests = digests
        """Chained digests of the prompt's full pages."""
        self.shared: list[int | tuple[int, int]] = []
        """Its leading pages: a cached page, or (prompt, page index) that an earlier prompt of
        the batch computes."""
        self.new_pages = 0


class AdmissionPlan:
    """Where the pages of a batch of new prompts come from, judged against the cache as it is.

    `add` plans one more prompt after those already added (it may share the full pages they will
    compute) and returns how many of its leading tokens are cached; `pages` is how many of the
    cache's free pages the whole batch takes. Planning changes nothing; `prefill` replans the
    same prompts in the same order, so a plan that fits predicts that admission exactly.
    """

    def __init__(self, cache: KVCache):
        self._cache = cache
        self.prompts: list[_Planned] = []
        self.pages = 0
        self.revived: set[int] = set()
        """Unreferenced cached pages the batch shares: they leave the LRU list."""
        self._computed: dict[bytes, tuple[int, int]] = {}

    def add(self, token_ids: Sequence[int]) -> int:
        cache, size = self._cache, self._cache.page_size
        n = len(token_ids)
        digests = cache.page_digests(token_ids) if cache.prefix_caching else []
        planned = _Planned(digests)
        # At least the last token is computed: its hidden state gives the first sampled token.
        for digest in digests[: (n - 1) // size]:
            page = cache._page_of.get(digest)
            if page is not None:
                planned.shared.append(page)
                if cache._refs[page] == 0 and page not in self.revived:
                    self.revived.add(page)
                    self.pages += 1
            elif digest in self._computed:
                planned.shared.append(self._computed[digest])
            else:
                break
        planned.new_pages = math.ceil(n / size) - len(planned.shared)
        self.pages += planned.new_pages
        index = len(self.prompts)
        for j in range(len(planned.shared), len(digests)):
            if digests[j] not in cache._page_of:
                self._computed.setdefault(digests[j], (index, j))
        self.prompts.append(planned)
        return len(planned.shared) * size


def kv_cache_bytes(args: ModelArgs, tokens: int, itemsize: int) -> int:
    """What a cache of `tokens` tokens holds for a model of `args`: keys and values of every
    layer's KV heads, `itemsize` bytes an entry."""
    return tokens * args.num_layers * 2 * args.num_kv_heads * args.head_dim * itemsize


class KVCache:
    """Keys and values of up to `capacity_tokens` tokens, in pages of `page_size` slots, with
    full pages shared between sequences by prefix digest unless `prefix_caching` is False."""

    def __init__(
        self,
        args: ModelArgs,
        capacity_tokens: int,
        *,
        page_size: int = 16,
        prefix_caching: bool = True,
        attention_chunk_tokens: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if capacity_tokens < page_size or page_size < 1:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} must be >= page_size={page_size} >= 1"
            )
        if attention_chunk_tokens is None:
            attention_chunk_tokens = max(1, DEFAULT_CHUNK_TOKENS // page_size) * page_size
        if attention_chunk_tokens < page_size or attention_chunk_tokens % page_size:
            raise ValueError(
                f"attention_chunk_tokens={attention_chunk_tokens} must be a positive multiple "
                f"of page_size={page_size}"
            )
        self.page_size = page_size
        self.attention_chunk_tokens = attention_chunk_tokens
        """Keys per fixed-position chunk of the attention (`paged_attention.py`)."""
        self.num_pages = capacity_tokens // page_size
        self.prefix_caching = prefix_caching
        # Head-major, so a head's pages gather into one contiguous [pages, slots, D] block.
        shape = (args.num_layers, args.num_kv_heads, self.num_pages * page_size, args.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._refs = [0] * self.num_pages
        # Unreferenced pages holding nothing cached: a stack, pop() hands out the lowest first.
        self._unused = list(range(self.num_pages - 1, -1, -1))
        # Unreferenced pages still registered under their digest, least recently released first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._page_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._seqs: dict[int, _Sequence] = {}
        # Reused gather buffers (keys, values): fp32, and in the cache's dtype when it differs.
        self._workspaces: list[Tensor | None] = [None, None]
        self._staging: list[Tensor | None] = [None, None]

    @classmethod
    def for_model(
        cls,
        model: Transformer,
        capacity_tokens: int,
        *,
        page_size: int = 16,
        prefix_caching: bool = True,
        attention_chunk_tokens: int | None = None,
    ) -> KVCache:
        """A cache in the model's dtype and on its device."""
        weight = model.embed_tokens.weight
        return cls(
            model.args,
            capacity_tokens,
            page_size=page_size,
            prefix_caching=prefix_caching,
            attention_chunk_tokens=attention_chunk_tokens,
            dtype=weight.dtype,
            device=weight.device,
        )

    # -- capacity -----------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """Pages no sequence references: unused ones, and cached ones not yet recycled."""
        return len(self._unused) + len(self._lru)

    @property
    def free_tokens(self) -> int:
        return self.free_pages * self.page_size

    @property
    def cached_pages(self) -> int:
        """Pages registered under a prefix digest, referenced or not."""
        return len(self._page_of)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits in the free pages now, sharing
        nothing (`plan()` counts what sharing saves)."""
        return math.ceil(num_tokens / self.page_size) <= self.free_pages

    def plan(self) -> AdmissionPlan:
        """An empty plan to `add` new prompts to; see `AdmissionPlan`."""
        return AdmissionPlan(self)

    def page_digests(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained digests of the full pages of a sequence starting with `token_ids`."""
        digests, parent, size = [], _ROOT, self.page_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = _digest(parent, token_ids[start : start + size])
            digests.append(parent)
        return digests

    # -- sequences ----------------------------------------------------------------------------

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: int) -> int:
        """Tokens cached for `seq_id`."""
        return self._seq(seq_id).length

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """The page table of `seq_id`, in token order."""
        return tuple(self._seq(seq_id).pages)

    def cached_tokens(self, seq_id: int) -> int:
        """Leading prompt tokens `seq_id` shared from the prefix cache instead of computing."""
        return self._seq(seq_id).cached

    def refcount(self, page: int) -> int:
        """How many sequences hold `page`."""
        return self._refs[page]

    def evict(self, seq_id: int) -> None:
        """Forget `seq_id` and drop its references; pages nobody holds any more become free,
        those registered under a digest stay cached until recycled."""
        pages = self._seq(seq_id).pages
        del self._seqs[seq_id]
        # Last page first: the LRU list recycles a sequence's tail before its prefix.
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._digest_of:
                self._lru[page] = None
            else:
                self._unused.append(page)

    def reset_prefix_cache(self) -> None:
        """Forget every digest; running sequences keep their pages but share and register none."""
        self._unused.extend(self._lru)
        self._lru.clear()
        self._page_of.clear()
        self._digest_of.clear()
        for seq in self._seqs.values():
            seq.parent = None
            seq.tail = []

    # -- internals used by prefill and decode -------------------------------------------------

    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not in the KV cache")
        return seq

    def _take_page(self) -> int:
        if self._unused:
            return self._unused.pop()
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._digest_of.pop(page)]
        return page

    def _admit(
        self, seq_ids: list[int], prompts: list[list[int]]
    ) -> tuple[list[int], list[tuple[int, bytes]]]:
        """Give new sequences their page tables: (cached tokens of each, the (page, digest) of
        each new full page to register once the prefill has written it)."""
        for seq_id in seq_ids:
            if seq_id in self._seqs or seq_ids.count(seq_id) > 1:
                raise ValueError(f"sequence {seq_id} is already in the KV cache")
        plan = self.plan()
        for tokens in prompts:
            plan.add(tokens)
        if plan.pages > self.free_pages:
            raise CacheFull(
                f"admitting {len(seq_ids)} sequences needs {plan.pages} pages, "
                f"{self.free_pages} are free"
            )
        # Revive the shared cached pages before allocating, which could recycle them.
        for page in plan.revived:
            del self._lru[page]
        tables: list[list[int]] = []
        register: list[tuple[int, bytes]] = []
        for seq_id, planned, tokens in zip(seq_ids, plan.prompts, prompts, strict=True):
            pages = [p if isinstance(p, int) else tables[p[0]][p[1]] for p in planned.shared]
            pages += [self._take_page() for _ in range(planned.new_pages)]
            for page in pages:
                self._refs[page] += 1
            tables.append(pages)
            # Its new full pages (the partial last one has no digest).
            new = len(planned.shared)
            register += zip(pages[new : len(planned.digests)], planned.digests[new:], strict=True)
            cached = len(planned.shared) * self.page_size
            seq = self._seqs[seq_id] = _Sequence(pages, len(tokens), cached, None)
            if self.prefix_caching:
                seq.parent = planned.digests[-1] if planned.digests else _ROOT
                seq.tail = list(tokens[len(planned.digests) * self.page_size :])
        return [len(p.shared) * self.page_size for p in plan.prompts], register

    def _register(self, pages: list[tuple[int, bytes]]) -> None:
        """Name full, written pages by their digest; a digest already cached keeps its page
        (this one stays private to its sequence)."""
        for page, digest in pages:
            if digest not in self._page_of:
                self._page_of[digest] = page
                self._digest_of[page] = digest

    def _append_one(
        self, seq_ids: list[int], tokens: list[int]
    ) -> tuple[Tensor, Tensor, Tensor, list[tuple[int, bytes]]]:
        """Grow each sequence by its token: (positions [B], new slots [B], lengths after [B],
        the (page, digest) of pages the step fills, to register once it has written them)."""
        seqs = [self._seq(seq_id) for seq_id in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in one decode step: {seq_ids}")
        size = self.page_size
        growing = [seq for seq in seqs if seq.length == len(seq.pages) * size]
        if len(growing) > self.free_pages:
            raise CacheFull(
                f"decode step needs {len(growing)} new pages, {self.free_pages} are free"
            )
        for seq in growing:
            page = self._take_page()
            self._refs[page] += 1
            seq.pages.append(page)
        positions = [seq.length for seq in seqs]
        slots = [
            seq.pages[p // size] * size + p % size for seq, p in zip(seqs, positions, strict=True)
        ]
        filled: list[tuple[int, bytes]] = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.length += 1
            if seq.parent is None:
                continue
            seq.tail.append(token)
            if len(seq.tail) == size:
                seq.parent = _digest(seq.parent, seq.tail)
                seq.tail = []
                filled.append((seq.pages[-1], seq.parent))
        device = self.keys.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)
        return as_tensor(positions), as_tensor(slots), as_tensor([p + 1 for p in positions]), filled

    def gather(self, layer: int, pages: Tensor, *, values: bool) -> Tensor:
        """Keys (or values) of `layer` in `pages[N]`, `[Hkv, N * page_size, D]` in fp32 (the
        attention's arithmetic, whatever the cache's dtype), written into a workspace that every
        call for the same side reuses: use them before the next call. Copying into a fresh tensor
        per call cost 6x the copy itself on the CPU (page faults on new memory)."""
        store = self.values if values else self.keys
        heads, rows = store.shape[1], pages.numel()
        width = self.page_size * store.shape[3]
        size = heads * rows * width
        buffer = self._workspace(self._workspaces, values, size, torch.float32)
        buffer = buffer.view(heads, rows, width)
        pages_of_layer = store[layer].view(heads, self.num_pages, width)
        if store.dtype == torch.float32:
            torch.index_select(pages_of_layer, 1, pages, out=buffer)
        else:
            staged = self._workspace(self._staging, values, size, store.dtype)
            torch.index_select(pages_of_layer, 1, pages, out=staged.view(heads, rows, width))
            buffer.view(-1).copy_(staged)
        return buffer.view(heads, rows * self.page_size, -1)

    def _workspace(
        self, spaces: list[Tensor | None], values: bool, size: int, dtype: torch.dtype
    ) -> Tensor:
        """The first `size` elements of a reused buffer of `dtype` (one per side), grown by a
        quarter past what is asked when it is too small."""
        space = spaces[values]
        if space is None or space.numel() < size:
            space = spaces[values] = self.keys.new_empty(size + size // 4, dtype=dtype)
        return space[:size]

    def _slots(self, seq_id: int, start: int, end: int) -> Tensor:
        positions = torch.arange(start, end)
        pages = torch.tensor(self._seqs[seq_id].pages, dtype=torch.long)
        slots = pages[positions // self.page_size] * self.page_size + positions % self.page_size
        return slots.to(self.keys.device)


@torch.no_grad()
def prefill(
    model: Transformer, cache: KVCache, seq_ids: list[int], prompts: list[Tensor]
) -> Tensor:
    """Admit `prompts` (1-D token tensors of any lengths) as `seq_ids`, computing only what the
    prefix cache does not hold; last hidden `[B, H]`."""
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
    starts, register = cache._admit(seq_ids, [p.tolist() for p in prompts])
    spans: list[QuerySpan] = []
    row = 0
    for seq_id, start, length in zip(seq_ids, starts, lengths, strict=True):
        spans.append((cache.pages(seq_id), row, start, length))
        row += length - start
    input_ids = torch.cat([p[s:] for p, s in zip(prompts, starts, strict=True)])
    positions = torch.cat([torch.arange(s, n) for s, n in zip(starts, lengths, strict=True)])
    slots = torch.cat(
        [cache._slots(i, s, n) for i, s, n in zip(seq_ids, starts, lengths, strict=True)]
    )
    hidden = _run_rows(model, cache, spans, input_ids, positions, slots)
    cache._register(register)
    ends = torch.tensor([n - s for s, n in zip(starts, lengths, strict=True)]).cumsum(0) - 1
    return hidden[ends.to(hidden.device)]


@torch.no_grad()
def decode(model: Transformer, cache: KVCache, seq_ids: list[int], tokens: Tensor) -> Tensor:
    """Feed `tokens[B]`, one per cached sequence in `seq_ids`; hidden `[B, H]` at those tokens."""
    if tokens.dim() != 1 or tokens.numel() != len(seq_ids) or not seq_ids:
        raise ValueError(
            f"decode needs one token per seq_id, "
            f"got tokens {tuple(tokens.shape)} for {len(seq_ids)} ids"
        )
    positions, slots, lengths, filled = cache._append_one(seq_ids, tokens.tolist())
    spans = [
        (cache.pages(seq_id), row, length - 1, length)
        for row, (seq_id, length) in enumerate(zip(seq_ids, lengths.tolist(), strict=True))
    ]
    hidden = _run_rows(model, cache, spans, tokens, positions, slots)
    cache._register(filled)
    return hidden


def _run_rows(
    model: Transformer,
    cache: KVCache,
    spans: list[QuerySpan],
    input_ids: Tensor,
    positions: Tensor,
    slots: Tensor,
) -> Tensor:
    """The layer stack over the step's new tokens (`input_ids`, `positions`, `slots`, in span
    order): each layer writes their keys and values into their slots, then attends through the
    page tables; hidden `[N, H]`. Fewer tokens than `linear_min_rows` are padded to that many
    rows, so the linear layers compute every row as in any larger batch (`paged_attention.py`)."""
    device = cache.keys.device
    n = input_ids.numel()
    padding = max(0, linear_min_rows(device) - n)
    input_ids = F.pad(input_ids.to(device), (0, padding))
    positions = F.pad(positions.to(device), (0, padding))
    queries = PagedQueries(cache, spans, model.args.num_heads // model.args.num_kv_heads)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.keys[layer].index_copy_(1, slots, k[:n].transpose(0, 1))
        cache.values[layer].index_copy_(1, slots, v[:n].transpose(0, 1))
        out = queries.attend(layer, q[:n]).to(q.dtype)
        return F.pad(out, (0, 0, 0, 0, 0, padding)) if padding else out

    return model.hidden_states(input_ids, positions, attend)[:n]
