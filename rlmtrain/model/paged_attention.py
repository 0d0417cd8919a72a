"""Attention over the paged KV cache that gives each query row the same bits in every batch.

Why: truncated importance sampling reads the engine's sampled-token log-probs, and a resumed or
repeated run must reproduce them exactly, while which requests share a step (and whether a
prompt's keys came from the prefix cache, an earlier prefill or a decode) depends on how fast
the REPLs answered. So a row's result may depend only on its own sequence: its queries, its keys
and values, its position.

The arithmetic every row gets, in prefill and decode alike. Keys are cut into chunks of
`chunk_tokens` at fixed absolute positions (chunk j holds positions [j*C, (j+1)*C)). A row at
position p takes its scores against chunks 0 .. p // C (positions after p masked), their exact
maximum m (a max is exact in any order), weights exp(s - m), and per chunk one product of C
weights with C values and one sum of C weights; the chunks' partial numerators and denominators
are then added in chunk order, one at a time (torch's own reductions over a dimension use several
accumulators, whose grouping depends on the length), and divided. Chunks a row cannot see, or
that it sees none of, add exact zeros.

What may change with the batch is only which rows share a product, and that is exact because a
CPU BLAS product computes a row the same way for any row count M from some small threshold up
and any batch count; below it the library switches to small-M kernels whose rounding differs.
The threshold depends on the library and the CPU (4 rows on one machine, 16 on another), so the
attention's is measured on the running machine, once per shape (`invariant_rows`), and the
linear layers use the safe `MIN_GEMM_ROWS`. So:
- short query spans (decode rows, short prefill suffixes) that read the same pages in their
  leading chunks share one product over those chunks (cascade attention: sequences behind one
  system prompt and history read its keys once), and each continues alone over the rest; their
  maximum is taken over both parts before any weight is formed;
- long spans (prefill) run in blocks of `BLOCK_ROWS` rows, each over the chunks up to its last
  row;
- every product gets at least the threshold's rows (items are padded), and `kv_cache.prefill`
  and `decode` pad the token rows of the linear layers to `MIN_GEMM_ROWS`.
This holds for the CPU BLAS; CUDA libraries choose kernels by shape, so on a GPU the engine is
exact but not batch-invariant, and pads nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor


class PagedKV(Protocol):
    """What the plan reads of a paged KV cache (`kv_cache.KVCache`, which plans with it)."""

    keys: Tensor
    page_size: int
    attention_chunk_tokens: int

    def gather(self, layer: int, pages: Tensor, *, values: bool) -> Tensor: ...


__all__ = [
    "BLOCK_ROWS",
    "MIN_GEMM_ROWS",
    "PagedQueries",
    "QuerySpan",
    "invariant_rows",
    "linear_min_rows",
]

MIN_GEMM_ROWS = 16
"""Fewest token rows the engine's linear layers get on the CPU (the highest threshold measured
on the machines this was built on; see the module docstring)."""

BLOCK_ROWS = 128
"""Query rows of a long span attended together (their scores over every chunk at once)."""

SCORES_BUDGET = 1 << 23
"""Score elements one batched product may hold (32 MiB in fp32); larger buckets are split."""

QuerySpan = tuple[Sequence[int], int, int, int]
"""(page table, first query row, first position, last position + 1) of one sequence's queries:
its rows are consecutive and sit at consecutive positions."""


def linear_min_rows(device: torch.device) -> int:
    """Token rows the engine pads its linear layers to on `device`."""
    return MIN_GEMM_ROWS if device.type == "cpu" else 1


_PROBE_ROWS = (*range(1, 65), 96, 128, 192, 256, 384, 512, 1024)


def invariant_rows(device: torch.device, dtype: torch.dtype, dim: int, chunk: int) -> int:
    """Fewest rows from which both attention products of one chunk, `[M, dim] @ [dim, chunk]`
    (scores) and `[M, chunk] @ [chunk, dim]` (weights times values), give every row the same
    bits for any larger M, as measured on this machine; 1 off the CPU (nothing to keep)."""
    if device.type != "cpu":
        return 1
    return _probe_rows(dtype, dim, chunk, torch.get_num_threads())


@functools.cache
def _probe_rows(dtype: torch.dtype, dim: int, chunk: int, threads: int) -> int:
    """`invariant_rows` on the CPU, with `threads` intra-op threads (the current count)."""
    gen = torch.Generator().manual_seed(0)
    most = _PROBE_ROWS[-1]
    keys = torch.randn(2, chunk, dim, generator=gen, dtype=dtype)
    values = torch.randn(2, chunk, dim, generator=gen, dtype=dtype)
    queries = torch.randn(2, most, dim, generator=gen, dtype=dtype)
    weights = torch.rand(2, most, chunk, generator=gen, dtype=dtype)
    scores = torch.bmm(queries, keys.transpose(1, 2))
    outputs = torch.bmm(weights, values)
    threshold = most
    for rows in reversed(_PROBE_ROWS[:-1]):
        same = torch.equal(
            torch.bmm(queries[:, :rows].contiguous(), keys.transpose(1, 2)), scores[:, :rows]
        ) and torch.equal(torch.bmm(weights[:, :rows].contiguous(), values), outputs[:, :rows])
        if not same:
            break
        threshold = rows
    return threshold


class _Item:
    """Rows attending to chunks [first, first + chunks) through `pages` (per chunk, padded)."""

    __slots__ = ("chunks", "first", "pages", "positions", "rows")

    def __init__(self, rows: list[int], positions: list[int], pages: list[int], first: int):
        self.rows, self.positions, self.pages, self.first = rows, positions, pages, first
        self.chunks = 0


class _Bucket:
    """Items of one padded shape (I items, R rows, J chunks) run as one batched product: rows
    `[I * R]` (the padding row where an item is short), pages `[I * J * P]`, and which keys each
    row sees."""

    __slots__ = ("hidden", "items", "mask_from", "pages", "row_index")

    def __init__(self, items: list[_Item], rows: int, chunks: int, plan: PagedQueries):
        chunk, per_chunk = plan.chunk_tokens, plan.pages_per_chunk
        page_ids: list[int] = []
        row_index: list[int] = []
        row_positions: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for item in items:
            page_ids += item.pages + [0] * (chunks * per_chunk - len(item.pages))
            short = rows - len(item.rows)
            row_index += item.rows + [plan.num_rows] * short
            # Padding rows see nothing: zero weights, discarded afterwards.
            row_positions += item.positions + [-1] * short
            starts.append(item.first * chunk)
            ends.append((item.first + item.chunks) * chunk)
        device = plan.device
        self.items = (len(items), rows, chunks)
        self.pages = torch.tensor(page_ids, dtype=torch.long, device=device)
        self.row_index = torch.tensor(row_index, dtype=torch.long, device=device)
        keys = torch.tensor(starts, device=device)[:, None] + torch.arange(
            chunks * chunk, device=device
        )
        inside = keys < torch.tensor(ends, device=device)[:, None]  # not a padding chunk
        positions = torch.tensor(row_positions, device=device).view(len(items), rows)
        visible = (keys[:, None, :] <= positions[:, :, None]) & inside[:, None, :]
        # As [1, I, J, R, 1, C], the layout of the scores, from the first chunk where a key is
        # hidden from some row (none: every key is seen).
        visible = visible.view(len(items), rows, chunks, chunk).transpose(1, 2)
        hidden = (~visible).flatten(2).any(dim=2).any(dim=0).nonzero()
        self.mask_from = int(hidden[0]) if hidden.numel() else chunks
        self.hidden = ~visible[None, :, self.mask_from :, :, None, :]


class PagedQueries:
    """Where every query row of one step reads, planned once and used by every layer.

    spans: one `QuerySpan` per sequence, covering rows 0 .. N-1 between them.
    """

    def __init__(self, cache: PagedKV, spans: Sequence[QuerySpan], heads_per_kv: int):
        self._cache = cache
        self.device = cache.keys.device
        self.chunk_tokens = cache.attention_chunk_tokens
        self.pages_per_chunk = self.chunk_tokens // cache.page_size
        self.heads_per_kv = heads_per_kv
        self.num_rows = sum(end - start for _, _, start, end in spans)
        keys = cache.keys
        self._min_rows = math.ceil(
            invariant_rows(keys.device, torch.float32, keys.shape[-1], self.chunk_tokens)
            / heads_per_kv
        )
        alone: list[_Item] = []
        shared: list[_Item] = []
        after: list[_Item] = []
        short: dict[tuple[int, ...], list[QuerySpan]] = {}
        for span in spans:
            table, first_row, start, end = span
            if end - start > self._min_rows:
                for block in range(start, end, BLOCK_ROWS):
                    stop = min(end, block + BLOCK_ROWS)
                    rows = list(range(first_row + block - start, first_row + stop - start))
                    alone.append(self._item(rows, list(range(block, stop)), table, 0, stop))
            else:
                short.setdefault(self._chunk_pages(table, 0), []).append(span)
        for members in short.values():
            common = self._common_chunks([table for table, *_ in members])
            common = min(common, *((end - 1) // self.chunk_tokens for *_, end in members))
            if len(members) < 2 or common < 1:
                for table, first_row, start, end in members:
                    rows = list(range(first_row, first_row + end - start))
                    alone.append(self._item(rows, list(range(start, end)), table, 0, end))
                continue
            rows, positions = [], []
            for _, first_row, start, end in members:
                rows += range(first_row, first_row + end - start)
                positions += range(start, end)
            begin = common * self.chunk_tokens
            shared.append(self._item(rows, positions, members[0][0], 0, begin))
            for table, first_row, start, end in members:
                mine = list(range(first_row, first_row + end - start))
                after.append(self._item(mine, list(range(start, end)), table, common, end))
        self._alone = self._buckets(alone)
        self._shared = self._buckets(shared)
        self._after = self._buckets(after)
        self.cascaded_rows = sum(len(item.rows) for item in shared)
        """Rows that read a shared product over their leading chunks."""

    # -- planning -----------------------------------------------------------------------------

    def _chunk_pages(self, table: Sequence[int], chunk: int) -> tuple[int, ...]:
        per = self.pages_per_chunk
        return tuple(table[chunk * per : (chunk + 1) * per])

    def _common_chunks(self, tables: list[Sequence[int]]) -> int:
        """Leading chunks whose whole pages all `tables` hold alike."""
        per, count = self.pages_per_chunk, 0
        while all(len(t) >= (count + 1) * per for t in tables) and all(
            self._chunk_pages(t, count) == self._chunk_pages(tables[0], count) for t in tables
        ):
            count += 1
        return count

    def _item(
        self, rows: list[int], positions: list[int], table: Sequence[int], first: int, end: int
    ) -> _Item:
        """An item over chunks [first, last) where `last` covers positions up to `end` - 1."""
        last = (end - 1) // self.chunk_tokens + 1
        per = self.pages_per_chunk
        item = _Item(rows, positions, list(table[first * per : last * per]), first)
        item.chunks = last - first
        return item

    def _buckets(self, items: list[_Item]) -> list[_Bucket]:
        """Items batched by padded rows and chunk count, each bucket within SCORES_BUDGET."""
        by_shape: dict[tuple[int, int], list[_Item]] = {}
        for item in items:
            rows = max(self._min_rows, len(item.rows))
            by_shape.setdefault((rows, item.chunks), []).append(item)
        buckets = []
        for (rows, chunks), members in by_shape.items():
            heads = self._cache.keys.shape[1] * self.heads_per_kv
            per_item = heads * rows * chunks * self.chunk_tokens
            step = max(1, SCORES_BUDGET // per_item)
            for at in range(0, len(members), step):
                buckets.append(_Bucket(members[at : at + step], rows, chunks, self))
        return buckets

    # -- attention ----------------------------------------------------------------------------

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """Attention of the rows' queries `q[N, Hq, D]` over their pages of `layer`, whose keys
        and values must already be written: `[N, Hq, D]` fp32."""
        n, heads, dim = q.shape
        queries = torch.cat([q.float(), q.new_zeros(1, heads, dim, dtype=torch.float32)])
        queries *= 1.0 / math.sqrt(dim)
        numerator = queries.new_zeros(n + 1, heads, dim)
        denominator = queries.new_zeros(n + 1, heads)
        for bucket in self._alone:
            scores = self._scores(layer, queries, bucket)
            # Over the keys of each chunk first (contiguous), then over the chunks.
            peak = scores.amax(dim=5, keepdim=True).amax(dim=2, keepdim=True)
            self._accumulate(layer, bucket, scores, peak, numerator, denominator)
        if self._shared:
            self._cascade(layer, queries, numerator, denominator)
        return numerator[:n] / denominator[:n, :, None]

    def _cascade(self, layer: int, queries: Tensor, numerator: Tensor, denominator: Tensor) -> None:
        """Rows in a cascade: scores of both parts, then the maximum over both, then the shared
        chunks' partials before the row's own, in chunk order."""
        parts = [
            (bucket, self._scores(layer, queries, bucket))
            for bucket in (*self._shared, *self._after)
        ]
        kv_heads, per_kv = self._cache.keys.shape[1], self.heads_per_kv
        row_peak = queries.new_full((self.num_rows + 1, kv_heads, per_kv), float("-inf"))
        for bucket, scores in parts:
            peaks = scores.amax(dim=5).amax(dim=2).permute(1, 2, 0, 3)
            peaks = peaks.reshape(-1, kv_heads, per_kv)
            index = bucket.row_index[:, None, None].expand_as(peaks)
            row_peak.scatter_reduce_(0, index, peaks, "amax")
        for bucket, scores in parts:
            items, rows, _ = bucket.items
            peak = row_peak[bucket.row_index].view(items, rows, kv_heads, per_kv)
            peak = peak.permute(2, 0, 1, 3)[:, :, None, :, :, None]
            self._accumulate(layer, bucket, scores, peak, numerator, denominator)

    def _scores(self, layer: int, queries: Tensor, bucket: _Bucket) -> Tensor:
        """`[Hkv, I, J, R, per_kv, C]` scaled scores of the bucket's rows, masked."""
        dim = queries.shape[2]
        kv_heads, per_kv, chunk = self._cache.keys.shape[1], self.heads_per_kv, self.chunk_tokens
        items, rows, chunks = bucket.items
        keys = self._cache.gather(layer, bucket.pages, values=False)  # [Hkv, I * J * C, D]
        stacked = queries[bucket.row_index].view(items, rows, kv_heads, per_kv, dim)
        stacked = stacked.permute(2, 0, 1, 3, 4)[:, :, None]  # [Hkv, I, 1, R, per_kv, D]
        stacked = stacked.expand(-1, -1, chunks, -1, -1, -1).reshape(-1, rows * per_kv, dim)
        scores = torch.bmm(stacked, keys.view(-1, chunk, dim).transpose(1, 2))
        scores = scores.view(kv_heads, items, chunks, rows, per_kv, chunk)
        if bucket.mask_from < chunks:
            scores[:, :, bucket.mask_from :].masked_fill_(bucket.hidden, float("-inf"))
        return scores

    def _accumulate(
        self,
        layer: int,
        bucket: _Bucket,
        scores: Tensor,
        peak: Tensor,
        numerator: Tensor,
        denominator: Tensor,
    ) -> None:
        """Add the bucket's chunk partials, weighted under `peak`, to its rows' running sums in
        chunk order (consumes `scores`)."""
        heads, dim = numerator.shape[1:]
        kv_heads, per_kv, chunk = self._cache.keys.shape[1], self.heads_per_kv, self.chunk_tokens
        items, rows, chunks = bucket.items
        values = self._cache.gather(layer, bucket.pages, values=True)
        # A row that sees nothing here has peak -inf: its weights must be 0, not nan.
        weights = scores.sub_(peak.clamp(min=torch.finfo(scores.dtype).min)).exp_()
        mass = weights.sum(dim=-1)  # [Hkv, I, J, R, per_kv]
        partial = torch.bmm(weights.view(-1, rows * per_kv, chunk), values.view(-1, chunk, dim))
        partial = partial.view(kv_heads, items, chunks, rows, per_kv, dim)
        grid = (items, rows, kv_heads, per_kv)
        row_sum = numerator[bucket.row_index].view(*grid, dim).permute(2, 0, 1, 3, 4)
        row_mass = denominator[bucket.row_index].view(grid).permute(2, 0, 1, 3)
        for j in range(chunks):
            row_sum = row_sum + partial[:, :, j]
            row_mass = row_mass + mass[:, :, j]
        numerator.index_copy_(
            0, bucket.row_index, row_sum.permute(1, 2, 0, 3, 4).reshape(-1, heads, dim)
        )
        denominator.index_copy_(
            0, bucket.row_index, row_mass.permute(1, 2, 0, 3).reshape(-1, heads)
        )
