"""Packed forward and backward equal separate per-sequence runs, for every backend that runs here.

On CPU that is sdpa (forward and gradients) and flex (forward; torch has no CPU backward for
flex_attention, which must surface as `BackendUnavailable`, not as a wrong gradient). On a CUDA
machine the `gpu` tests add flex gradients and flash-attn.
"""

import logging

import pytest
import torch

from rlmtrain import devices
from rlmtrain.config import ModelConfig
from rlmtrain.model import ModelArgs, RopeScaling, Transformer, build_model

LENGTHS = (1, 17, 130, 5)
TOLERANCE = 1e-5

QWEN3 = ModelArgs(
    family="qwen3",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
    qk_norm=True,
    tie_word_embeddings=True,
)
LLAMA = ModelArgs(
    family="llama",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=500_000.0,
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
)


def make_model(args: ModelArgs, attention: str, device: str = "cpu", **options) -> Transformer:
    model = Transformer(args, attention=attention, **options)
    model.init_weights(seed=0, std=0.1)
    return model.to(device)


def packed_inputs(vocab: int, device: str = "cpu", lengths=LENGTHS):
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(device)
    return sequences, torch.cat(sequences), positions, cu_seqlens


def one_sequence(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    n = tokens.numel()
    return model(
        tokens, torch.arange(n, device=tokens.device), torch.tensor([0, n], device=tokens.device)
    )


def packed_and_separate_grads(model: Transformer, device: str = "cpu"):
    """(packed hidden, separate hidden, packed grads, separate grads) for one random upstream."""
    sequences, ids, positions, cu_seqlens = packed_inputs(model.args.vocab_size, device)
    upstream = torch.randn(
        ids.numel(), model.args.hidden_size, generator=torch.Generator().manual_seed(4)
    )
    upstream = upstream.to(device)

    model.zero_grad()
    packed = model(ids, positions, cu_seqlens)
    (packed * upstream).sum().backward()
    packed_grads = grads_of(model)

    model.zero_grad()
    separate = torch.cat([one_sequence(model, s) for s in sequences])
    (separate * upstream).sum().backward()
    separate_grads = grads_of(model)
    return packed, separate, packed_grads, separate_grads


def grads_of(model: Transformer) -> dict[str, torch.Tensor]:
    # The untied LM head takes no part in forward (it returns hidden states), so it has no grad.
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict, tol: float) -> None:
    """Max abs difference <= tol per unit of the gradient's scale: weight gradients sum over
    every token, reach ~100 here, and fp32 summation order alone moves them by ~1e-5."""
    assert a.keys() == b.keys()
    for name in a:
        scale = max(1.0, b[name].abs().max().item())
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= tol * scale, f"gradient of {name} differs by {diff} (scale {scale})"


@pytest.mark.parametrize("args", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_sdpa_packed_equals_separate_with_gradients(args):
    model = make_model(args, "sdpa")
    packed, separate, packed_grads, separate_grads = packed_and_separate_grads(model)
    assert (packed - separate).abs().max().item() <= TOLERANCE
    assert_grads_close(packed_grads, separate_grads, TOLERANCE)


@pytest.mark.parametrize("args", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_flex_packed_forward_equals_sdpa(args):
    flex, sdpa = make_model(args, "flex"), make_model(args, "sdpa")
    sequences, ids, positions, cu_seqlens = packed_inputs(args.vocab_size)
    with torch.no_grad():
        packed = flex(ids, positions, cu_seqlens)
        separate = torch.cat([one_sequence(flex, s) for s in sequences])
        reference = sdpa(ids, positions, cu_seqlens)
    assert (packed - separate).abs().max().item() <= TOLERANCE
    assert (packed - reference).abs().max().item() <= TOLERANCE


def test_flex_refuses_cpu_backward_clearly():
    model = make_model(QWEN3, "flex")
    _, ids, positions, cu_seqlens = packed_inputs(QWEN3.vocab_size)
    with pytest.raises(devices.BackendUnavailable, match="attention='sdpa'"):
        model(ids, positions, cu_seqlens)


def test_activation_checkpointing_keeps_gradients():
    plain = make_model(QWEN3, "sdpa")
    checkpointed = make_model(QWEN3, "sdpa", activation_checkpointing=True)
    _, _, plain_grads, _ = packed_and_separate_grads(plain)
    _, _, ckpt_grads, _ = packed_and_separate_grads(checkpointed)
    assert_grads_close(plain_grads, ckpt_grads, 1e-6)


def test_bfloat16_forward_tracks_float32():
    fp32 = make_model(QWEN3, "sdpa")
    bf16 = make_model(QWEN3, "sdpa").to(torch.bfloat16)
    _, ids, positions, cu_seqlens = packed_inputs(QWEN3.vocab_size)
    with torch.no_grad():
        exact = fp32(ids, positions, cu_seqlens)
        rounded = bf16(ids, positions, cu_seqlens)
    assert rounded.dtype == torch.bfloat16
    relative = (rounded.float() - exact).norm() / exact.norm()
    assert relative.item() < 2e-2


def test_lm_head_weight_tied_and_untied():
    tied, untied = make_model(QWEN3, "sdpa"), make_model(LLAMA, "sdpa")
    assert tied.lm_head_weight is tied.embed_tokens.weight
    assert untied.lm_head_weight is untied.lm_head.weight
    assert untied.lm_head_weight.shape == (LLAMA.vocab_size, LLAMA.hidden_size)


def test_bad_packing_is_named():
    model = make_model(QWEN3, "sdpa")
    ids = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="T=10"):
        model(ids, torch.arange(10), torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="empty sequence"):
        model(ids, torch.arange(10), torch.tensor([0, 4, 4, 10]))
    with pytest.raises(ValueError, match="1-D"):
        model(ids[None], torch.arange(10)[None], torch.tensor([0, 10]))


@pytest.mark.skipif(devices.HAS_FLASH_ATTN, reason="flash-attn is installed here")
def test_explicit_flash_without_flash_attn_raises():
    with pytest.raises(devices.BackendUnavailable, match="flash-attn"):
        Transformer(QWEN3, attention="flash")


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'fast'"):
        Transformer(QWEN3, attention="fast")


@pytest.mark.skipif(devices.HAS_CUDA, reason="checks the CPU fallback")
def test_auto_falls_back_to_sdpa_and_logs_once(caplog):
    model = make_model(QWEN3, "auto")
    _, ids, positions, cu_seqlens = packed_inputs(QWEN3.vocab_size)
    devices._logged.discard("attention-auto-sdpa")
    with caplog.at_level(logging.INFO, logger="rlmtrain"):
        auto = model(ids, positions, cu_seqlens)
        model(ids, positions, cu_seqlens)
    fallbacks = [r for r in caplog.records if "per-sequence SDPA" in r.getMessage()]
    assert len(fallbacks) == 1
    model.attention = "sdpa"
    assert torch.equal(auto, model(ids, positions, cu_seqlens))


def test_build_model_from_preset_is_seeded():
    cfg = ModelConfig(preset="tiny", seed=7, dtype="bfloat16", activation_checkpointing=True)
    a, b = build_model(cfg), build_model(cfg)
    c = build_model(ModelConfig(preset="tiny", seed=8))
    assert a.args.vocab_size == 384 and a.activation_checkpointing
    assert a.embed_tokens.weight.dtype == torch.bfloat16
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.embed_tokens.weight.float(), c.embed_tokens.weight)
    assert 1_000_000 < sum(p.numel() for p in c.parameters()) == c.args.num_params() < 10_000_000


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["flex", "flash"])
def test_cuda_backends_packed_equal_separate_with_gradients(attention):
    if attention == "flash" and not devices.HAS_FLASH_ATTN:
        pytest.skip("flash-attn not installed")
    model = make_model(QWEN3, attention, device="cuda")
    packed, separate, packed_grads, separate_grads = packed_and_separate_grads(model, "cuda")
    # GPU kernels reorder sums (and flash computes in lower precision internally), so allow more.
    assert (packed - separate).abs().max().item() <= 1e-4
    assert_grads_close(packed_grads, separate_grads, 1e-3)
