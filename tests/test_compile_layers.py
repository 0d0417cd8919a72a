"""`compile_layers`: each decoder layer's work around attention runs as two compiled regions.

The compiled forward and its gradients equal the eager ones; the regions compile once for all the
layers (a graph per layer would be 28 compilations for Qwen3-0.6B, and past dynamo's recompile
limit layers would run eager) and once for all token counts (marked dynamic from the first call);
the KV-cache path the engine takes stays eager. On CUDA (`gpu`), the same in bf16 with the flex
backend, the training configuration.
"""

from __future__ import annotations

import msgspec
import pytest
import test_model_packed
import torch
from small_model import ARGS as KV_ARGS
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from rlmtrain.config import ModelConfig
from rlmtrain.model import KVCache, ModelArgs, Transformer, build_model
from rlmtrain.model.kv_cache import decode, prefill
from rlmtrain.model.transformer import attention_inputs, attention_output

# The packed-model tests' shapes with a third layer, so a graph per layer would show.
QWEN3 = msgspec.structs.replace(test_model_packed.QWEN3, num_layers=3)
LLAMA = msgspec.structs.replace(test_model_packed.LLAMA, num_layers=3)
BATCHES = ((17, 130, 5), (40, 3), (64, 64, 9, 1))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    # Past the recompile limit dynamo would run the regions eager with only a warning.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def packed(vocab: int, lengths: tuple[int, ...], device: str = "cpu"):
    """The model's packed inputs (tokens, positions, cu_seqlens) for sequences of `lengths`."""
    return test_model_packed.packed_inputs(vocab, device, lengths)[1:]


def forward_backward(model: Transformer, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    hidden = model(*batch)
    # A loss that weighs every position differently, so a row mixed up shows.
    weights = torch.linspace(-1.0, 1.0, hidden.numel(), device=hidden.device)
    (hidden.float().flatten() * weights).sum().backward()
    # An untied LM head takes no gradient here (the head is the caller's).
    return hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def twin_models(args: ModelArgs, attention: str = "sdpa", **options):
    eager = Transformer(args, attention=attention, **options)
    eager.init_weights(seed=0, std=0.1)
    compiled = Transformer(args, attention=attention, compile_layers=True, **options)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def assert_near(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each tensor within 1e-5 of the largest entry of its reference: fused kernels sum in
    another order (a gradient accumulated over 150 tokens moves by a few ulps of its largest
    entry), while a wrong region (a RoPE half swapped, a norm missed) is off by the entries
    themselves."""
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        assert (g - w).abs().max().item() <= 1e-5 * scale, (g - w).abs().max().item() / scale


def compilations() -> int:
    """Graphs compiled for the two regions (on CUDA, flex attention's own compiled graphs are
    not counted)."""
    return sum(
        len(_debug_get_cache_entry_list(region.__code__))
        for region in (attention_inputs, attention_output)
    )


@pytest.mark.slow
@pytest.mark.parametrize("args", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_compiled_layers_equal_eager_and_compile_once_for_every_layer(args):
    eager, compiled = twin_models(args)
    for lengths in BATCHES:
        batch = packed(args.vocab_size, lengths)
        want, want_grads = forward_backward(eager, batch)
        got, got_grads = forward_backward(compiled, batch)
        assert_near([got, *got_grads], [want, *want_grads])
    # One graph a region, the token count dynamic from the start: three layers, three lengths.
    assert compilations() == 2
    # Without gradients (pi_old, the KL reference): one more graph a region.
    with torch.no_grad():
        for lengths in BATCHES:
            batch = packed(args.vocab_size, lengths)
            assert_near([compiled(*batch)], [eager(*batch)])
    assert compilations() == 4


@pytest.mark.slow
def test_compiled_layers_under_activation_checkpointing_equal_eager():
    eager, compiled = twin_models(QWEN3, activation_checkpointing=True)
    batch = packed(QWEN3.vocab_size, BATCHES[0])
    want, want_grads = forward_backward(eager, batch)
    got, got_grads = forward_backward(compiled, batch)
    assert_near([got, *got_grads], [want, *want_grads])
    assert compilations() > 0


def test_the_kv_cache_path_stays_eager():
    """The engine's prefill and decode run the layers through `hidden_states`: nothing compiles
    there, so the engine's rows stay those of any larger batch, bit for bit."""
    model = Transformer(KV_ARGS, attention="sdpa", compile_layers=True)
    model.init_weights(seed=0, std=0.5)
    eager = Transformer(KV_ARGS, attention="sdpa")
    eager.load_state_dict(model.state_dict())
    prompts = [torch.arange(20), torch.arange(40, 49)]
    hidden = []
    for each in (model, eager):
        cache = KVCache.for_model(each, capacity_tokens=128, page_size=16)
        prefill(each, cache, [0, 1], prompts)
        hidden.append(decode(each, cache, [1, 0], torch.tensor([7, 8])))
    assert torch.equal(hidden[0], hidden[1])
    assert compilations() == 0


def test_the_config_switch_reaches_the_model():
    assert build_model(ModelConfig(preset="tiny", compile_layers=True)).compile_layers
    assert not build_model(ModelConfig(preset="tiny")).compile_layers


@pytest.mark.gpu
def test_compiled_layers_on_cuda_in_bf16_track_eager():
    """bf16 with the flex backend: compiled and eager each judged by their error against fp32,
    since fused kernels round differently (once per fused region, not once per operation)."""
    reference, compiled = twin_models(QWEN3, attention="flex")
    eager = Transformer(QWEN3, attention="flex")
    eager.load_state_dict(reference.state_dict())
    reference = reference.cuda()
    eager, compiled = eager.cuda().to(torch.bfloat16), compiled.cuda().to(torch.bfloat16)
    for lengths in BATCHES:
        batch = packed(QWEN3.vocab_size, lengths, "cuda")
        exact, exact_grads = forward_backward(reference, batch)
        for name, model in (("eager", eager), ("compiled", compiled)):
            hidden, grads = forward_backward(model, batch)
            errors = [(hidden.float() - exact).abs().max().item()]
            errors += [
                (g.float() - w).abs().max().item() for g, w in zip(grads, exact_grads, strict=True)
            ]
            if name == "eager":
                bounds = [2 * e + 1e-3 for e in errors]
            else:
                assert all(e <= b for e, b in zip(errors, bounds, strict=True)), (errors, bounds)
    assert compilations() == 2
