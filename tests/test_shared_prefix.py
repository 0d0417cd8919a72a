"""Shared prefixes are laid out once and change nothing a loss can see.

Samples that begin with the same tokens (the system prompt) are packed as one prefix row and
rows continuing it. The hidden states at every sample position, the GRPO and NLL losses and the
gradients must equal those of the plain layout where every sample carries its own copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlmtrain import devices
from rlmtrain.algo import IGNORE_INDEX, Sample, collate, pack
from rlmtrain.algo.prefixes import Segment, prefix_segments
from rlmtrain.algo.unfused import unfused_grpo_loss
from tests.test_model_packed import LLAMA, QWEN3, make_model

TOLERANCE = 1e-5


def _sample(i: int, tokens: np.ndarray, prompt_len: int, rng: np.random.Generator) -> Sample:
    completion = tokens.shape[0] - prompt_len
    return Sample(
        task_id=f"task{i % 3}",
        root_id=f"r{i}",
        trajectory_id=f"t{i}",
        depth=0,
        turn=i,
        input_ids=tokens.astype(np.int64),
        prompt_len=prompt_len,
        sampler_logp=-rng.random(completion, dtype=np.float32),
        advantages=rng.normal(size=completion).astype(np.float32),
        weights=rng.random(completion, dtype=np.float32) / 100,
    )


def system_prompt_batch(seed: int = 0, vocab: int = 300) -> list[Sample]:
    """Two system prompts (one 40 tokens, one 25), samples behind each with random turns and a
    few samples that share nothing."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, 40), rng.integers(0, vocab, 25)]
    samples = []
    for i in range(14):
        head = systems[i % 2] if i < 12 else np.empty(0, np.int64)
        own_prompt = rng.integers(0, vocab, int(rng.integers(1, 30)))
        completion = rng.integers(0, vocab, int(rng.integers(1, 12)))
        tokens = np.concatenate([head, own_prompt, completion])
        samples.append(_sample(i, tokens, head.shape[0] + own_prompt.shape[0], rng))
    return samples


def test_segments_cover_every_sample_once_and_never_reach_a_trained_token():
    samples = system_prompt_batch()
    segments = prefix_segments(samples, budget=10_000, min_tokens=16)
    members = np.concatenate([g.members for g in segments])
    assert sorted(members.tolist()) == list(range(len(samples)))
    shared = {g.prefix_len for g in segments if g.prefix_len}
    assert shared == {40, 25}  # one segment per system prompt, at least its whole length
    for g in segments:
        first = samples[int(g.members[0])].input_ids[: g.prefix_len]
        for i in g.members.tolist():
            assert g.prefix_len <= samples[i].prompt_len - 1
            np.testing.assert_array_equal(samples[i].input_ids[: g.prefix_len], first)
    assert all(len(g.members) == 1 for g in segments if g.prefix_len == 0)
    off = prefix_segments(samples, budget=10_000, min_tokens=0)
    assert [g.prefix_len for g in off] == [0] * len(samples)


def test_segments_respect_the_budget():
    samples = system_prompt_batch(seed=1)
    budget = 120
    for g in prefix_segments(samples, budget=budget, min_tokens=16):
        laid_out = g.prefix_len + sum(samples[i].length - g.prefix_len for i in g.members)
        assert laid_out <= budget


def test_packed_layout_reconstructs_every_sample():
    samples = system_prompt_batch(seed=2)
    packed = pack(samples, 256, shared_prefix_tokens=16)
    assert packed.stats.shared_tokens > 0
    assert packed.stats.tokens == sum(s.length for s in samples) - packed.stats.shared_tokens
    seen = []
    for batch in packed.micro_batches():
        assert (batch.prefix_of >= 0).any() and batch.num_tokens <= 256
        cu, parents = batch.cu_seqlens.tolist(), batch.prefix_of.tolist()
        placed = zip(batch.sample_indices.tolist(), batch.sample_rows.tolist(), strict=True)
        for index, row in placed:
            seen.append(index)
            spans = [slice(cu[row], cu[row + 1])]
            if parents[row] >= 0:
                spans.insert(0, slice(cu[parents[row]], cu[parents[row] + 1]))
            s = samples[index]
            ids = np.concatenate([batch.input_ids[span].numpy() for span in spans])
            np.testing.assert_array_equal(ids, s.input_ids)
            own = spans[-1]
            start = s.length - (own.stop - own.start)
            np.testing.assert_array_equal(
                batch.position_ids[own].numpy(), np.arange(start, s.length)
            )
            np.testing.assert_array_equal(batch.targets[own].numpy(), s.targets()[start:])
            np.testing.assert_array_equal(
                batch.weights[own].numpy()[s.loss_mask()[start:]], s.weights
            )
        prefix_rows = [r for r, p in enumerate(parents) if p == -1 and r not in batch.sample_rows]
        for r in prefix_rows:  # a prefix row trains nothing
            assert (batch.targets[cu[r] : cu[r + 1]] == IGNORE_INDEX).all()
    assert sorted(seen) == list(range(len(samples)))


def _hidden_per_sample(model, batch) -> dict[int, torch.Tensor]:
    hidden = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.prefix_of)
    cu, parents = batch.cu_seqlens.tolist(), batch.prefix_of.tolist()
    out = {}
    for index, row in zip(batch.sample_indices.tolist(), batch.sample_rows.tolist(), strict=True):
        parts = [hidden[cu[row] : cu[row + 1]]]
        if parents[row] >= 0:
            parts.insert(0, hidden[cu[parents[row]] : cu[parents[row] + 1]])
        out[index] = torch.cat(parts)
    return out


@pytest.mark.parametrize("args", [QWEN3, LLAMA], ids=["qwen3", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_hidden_states_equal_the_copied_layout(args, attention):
    model = make_model(args, attention)
    samples = system_prompt_batch(seed=3)
    plain = collate(samples)
    shared = next(pack(samples, 10_000, shared_prefix_tokens=16).micro_batches())
    assert shared.num_tokens < plain.num_tokens
    with torch.no_grad():
        expected, got = _hidden_per_sample(model, plain), _hidden_per_sample(model, shared)
    for index in range(len(samples)):
        assert (expected[index] - got[index]).abs().max().item() <= TOLERANCE


def _grpo_gradients(model, batches):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        hidden = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.prefix_of)
        loss, _ = unfused_grpo_loss(
            hidden,
            model.lm_head_weight,
            batch.targets,
            None,
            batch.advantages,
            batch.weights,
        )
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("args", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_grpo_loss_and_gradients_equal_the_copied_layout(args):
    model = make_model(args, "sdpa")
    samples = system_prompt_batch(seed=4)
    plain_loss, plain = _grpo_gradients(model, pack(samples, 150).micro_batches())
    shared_batches = pack(samples, 150, shared_prefix_tokens=16)
    assert shared_batches.stats.shared_tokens > 0
    shared_loss, shared = _grpo_gradients(model, shared_batches.micro_batches())
    assert shared_loss == pytest.approx(plain_loss, abs=TOLERANCE)
    for name, grad in plain.items():
        scale = max(1.0, grad.abs().max().item())
        assert (grad - shared[name]).abs().max().item() <= TOLERANCE * scale, name


def test_world_size_splits_a_segment_before_adding_empty_micro_batches():
    samples = system_prompt_batch(seed=5)[:12:2]  # six samples behind one system prompt
    packed = pack(samples, 10_000, world_size=2, shared_prefix_tokens=16)
    assert packed.stats.empty_micro_batches == 0
    assert [len(rank) for rank in packed.plan.ranks] == [1, 1]
    assert all(g.prefix_len == 40 for rank in packed.plan.segments for mb in rank for g in mb)


def test_bad_layouts_are_refused():
    samples = system_prompt_batch(seed=6)
    with pytest.raises(ValueError, match="segments' members"):
        collate(samples, [0, 2], [Segment(0, np.array([2, 0]))])
    with pytest.raises(ValueError, match="does not begin with its segment's prefix"):
        collate(samples, [0, 1], [Segment(20, np.array([0, 1]))])
    model = make_model(QWEN3, "sdpa")
    ids = torch.zeros(9, dtype=torch.long)
    cu = torch.tensor([0, 3, 6, 9])
    with pytest.raises(ValueError, match=r"prefix_of\[2\] = 1"):
        model(ids, torch.arange(9), cu, torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="one entry per row"):
        model(ids, torch.arange(9), cu, torch.tensor([-1, 0]))


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["flex", "flash"])
def test_cuda_backends_equal_the_copied_layout_with_gradients(attention):
    """bf16 on CUDA: the shared-prefix layout's hidden states and weight gradients are as close to
    the fp32 copied layout as the bf16 copied layout is. The two bf16 layouts round along
    different paths (a few units in the last place after several layers), so each is judged by
    its error against fp32, not against the other."""
    if attention == "flash" and not devices.HAS_FLASH_ATTN:
        pytest.skip("flash-attn not installed")
    samples = system_prompt_batch(seed=7)
    plain = collate(samples).to("cuda")
    shared = next(pack(samples, 10_000, shared_prefix_tokens=16).micro_batches()).to("cuda")
    assert shared.num_tokens < plain.num_tokens

    def hidden_and_grads(dtype: torch.dtype, batch, backend: str = attention):
        model = make_model(QWEN3, backend, device="cuda").to(dtype)
        per_sample = _hidden_per_sample(model, batch)
        hidden = torch.cat([per_sample[i] for i in range(len(samples))]).float()
        gen = torch.Generator(device="cuda").manual_seed(0)
        upstream = torch.randn(hidden.shape, generator=gen, device="cuda")
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad((hidden * upstream).sum(), params, allow_unused=True)
        return hidden.detach(), torch.cat([g.float().flatten() for g in grads if g is not None])

    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    truth = hidden_and_grads(torch.float32, plain, "flex")  # flash-attn runs 16-bit only
    copied = hidden_and_grads(torch.bfloat16, plain)
    prefixed = hidden_and_grads(torch.bfloat16, shared)
    for what, t, c, p in zip(("hidden", "grads"), truth, copied, prefixed, strict=True):
        assert rel_err(c, t) < 5e-2, what  # bf16 itself is sound here (about 1e-2 and 2e-2)
        assert rel_err(p, t) <= 2 * rel_err(c, t), what
