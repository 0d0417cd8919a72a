"""KV-cache generation equals full recomputation, token for token, under admission and eviction.

A small continuous-batching loop drives the cache the way the native engine will: prompts wait
until their pages fit, are prefilled together, decode in one ragged batch, and are evicted when
done, which frees pages for the prompts still waiting. The reference regenerates each prompt
alone by running the full packed forward over the whole sequence at every step.
"""

import pytest
import torch
from small_model import ARGS, make_model

from rlmtrain.model import CacheFull, KVCache, Transformer
from rlmtrain.model.kv_cache import decode, prefill

PAGE = 8


def greedy(hidden: torch.Tensor, model: Transformer) -> torch.Tensor:
    return (hidden @ model.lm_head_weight.T).argmax(-1)


def reference_generation(model: Transformer, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    tokens = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(new_tokens):
            n = tokens.numel()
            hidden = model(tokens, torch.arange(n), torch.tensor([0, n]))
            nxt = greedy(hidden[-1:], model)
            out.append(int(nxt))
            tokens = torch.cat([tokens, nxt])
    return out


def cached_generation(model, cache, prompts, budgets, log):
    """Greedy-generate `budgets[i]` tokens for each prompt through `cache`; admission and
    eviction events are appended to `log` as (step, event, seq_id, pages)."""
    waiting = list(range(len(prompts)))
    active: dict[int, list[int]] = {}
    outputs: dict[int, list[int]] = {}
    # The cache allocates pages as sequences grow; like an engine, the loop reserves each
    # sequence's final size up front so that decoding never hits CacheFull.
    reserved: dict[int, int] = {}
    capacity = cache.free_tokens
    step = 0
    while waiting or active:
        admit = []
        for seq in list(waiting):
            need = -(-(prompts[seq].numel() + budgets[seq]) // PAGE) * PAGE
            if need <= capacity - sum(reserved.values()):
                admit.append(seq)
                waiting.remove(seq)
                reserved[seq] = need
        if admit:
            hidden = prefill(model, cache, admit, [prompts[s] for s in admit])
            for seq, token in zip(admit, greedy(hidden, model).tolist(), strict=True):
                active[seq] = [token]
                log.append((step, "admit", seq, cache.pages(seq)))
        decoding = [s for s in active if len(active[s]) < budgets[s]]
        if decoding:
            last = torch.tensor([active[s][-1] for s in decoding])
            for seq, token in zip(
                decoding, greedy(decode(model, cache, decoding, last), model).tolist(), strict=True
            ):
                active[seq].append(token)
        for seq in [s for s in active if len(active[s]) == budgets[s]]:
            log.append((step, "evict", seq, cache.pages(seq)))
            assert cache.length(seq) == prompts[seq].numel() + budgets[seq] - 1
            cache.evict(seq)
            del reserved[seq]
            outputs[seq] = active.pop(seq)
        step += 1
        assert step < 100, "generation loop did not finish"
    return [outputs[s] for s in range(len(prompts))]


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_cached_generation_equals_full_recompute(attention):
    model = make_model(attention)
    gen = torch.Generator().manual_seed(5)
    lengths, budgets = [3, 11, 26, 7, 19], [12, 5, 9, 14, 6]
    prompts = [torch.randint(0, ARGS.vocab_size, (n,), generator=gen) for n in lengths]
    # 64 slots hold prompts 0, 1 and 3 (16 + 16 + 24 slots reserved); 2 and 4 wait for evictions.
    cache = KVCache.for_model(model, capacity_tokens=64, page_size=PAGE)
    log = []
    generated = cached_generation(model, cache, prompts, budgets, log)

    reference = [reference_generation(model, p, b) for p, b in zip(prompts, budgets, strict=True)]
    assert generated == reference

    admit_steps = {seq: step for step, event, seq, _ in log if event == "admit"}
    assert len(set(admit_steps.values())) >= 3, "prompts were not admitted at different steps"
    first_evict = min(step for step, event, _, _ in log if event == "evict")
    late = [seq for seq, step in admit_steps.items() if step > first_evict]
    freed = {
        p
        for step, event, _, pages in log
        if event == "evict" and step < admit_steps[late[0]]
        for p in pages
    }
    late_pages = next(pages for _, event, seq, pages in log if event == "admit" and seq == late[0])
    assert set(late_pages) & freed, "a late admission did not reuse freed pages"
    assert cache.free_tokens == 64


def test_decode_handles_ragged_lengths_in_one_batch():
    model = make_model()
    prompts = [torch.tensor([5]), torch.arange(20), torch.arange(40, 49)]
    cache = KVCache.for_model(model, capacity_tokens=128, page_size=PAGE)
    prefill(model, cache, [10, 11, 12], prompts)
    tokens = torch.tensor([7, 8, 9])
    hidden = decode(model, cache, [12, 10, 11], tokens)
    for row, (seq, prompt) in enumerate(
        zip([12, 10, 11], [prompts[2], prompts[0], prompts[1]], strict=True)
    ):
        full = torch.cat([prompt, tokens[row : row + 1]])
        with torch.no_grad():
            expected = model(full, torch.arange(full.numel()), torch.tensor([0, full.numel()]))[-1]
        assert (hidden[row] - expected).abs().max().item() <= 1e-5
        assert cache.length(seq) == full.numel()


def test_full_cache_raises_without_changing_state():
    model = make_model()
    cache = KVCache.for_model(model, capacity_tokens=32, page_size=PAGE)
    prefill(model, cache, [0], [torch.arange(24)])
    # Tokens unlike sequence 0's: arange(9) would share its first page and fit.
    with pytest.raises(CacheFull, match="needs 2 pages, 1 are free"):
        prefill(model, cache, [1], [torch.arange(100, 109)])
    assert 1 not in cache and cache.free_tokens == 8
    prefill(model, cache, [1], [torch.arange(8)])
    with pytest.raises(CacheFull, match="decode step needs 1 new pages, 0 are free"):
        decode(model, cache, [1], torch.tensor([3]))
    assert cache.length(1) == 8
    cache.evict(0)
    assert cache.free_tokens == 24
    decode(model, cache, [1], torch.tensor([3]))
    assert cache.length(1) == 9 and len(cache.pages(1)) == 2


def test_cache_misuse_is_named():
    model = make_model()
    cache = KVCache.for_model(model, capacity_tokens=64, page_size=PAGE)
    prefill(model, cache, [4], [torch.arange(3)])
    with pytest.raises(ValueError, match="sequence 4 is already"):
        prefill(model, cache, [4], [torch.arange(3)])
    with pytest.raises(ValueError, match="sequence 5 is already"):
        prefill(model, cache, [5, 5], [torch.arange(3), torch.arange(2)])
    assert 5 not in cache and cache.free_tokens == 56
    with pytest.raises(KeyError, match="sequence 9 is not"):
        decode(model, cache, [9], torch.tensor([1]))
    with pytest.raises(ValueError, match="one token per seq_id"):
        decode(model, cache, [4], torch.tensor([1, 2]))
