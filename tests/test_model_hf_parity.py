"""Our packed forward against transformers' Qwen3 and Llama models, run one sequence at a time.

The Hugging Face models are built with random weights (norm scales perturbed too, so q/k norm
is exercised), saved with `save_pretrained`, loaded by `load_hf`, and compared on a packed batch
of lengths 1, 17 and 130 in fp32. transformers' `last_hidden_state` includes the final norm, as
ours does.
"""

import pytest
import torch
import transformers

from rlmtrain.model import load_hf

LENGTHS = (1, 17, 130)
TOLERANCE = 1e-4


def small_hf_config(family: str) -> transformers.PretrainedConfig:
    shape = dict(
        vocab_size=1000,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        return transformers.Qwen3Config(rope_theta=10_000.0, **shape)
    rope_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return transformers.LlamaConfig(rope_theta=500_000.0, rope_scaling=rope_scaling, **shape)


def random_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        small_hf_config(family), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
    return model.eval()


def packed_batch(vocab: int, lengths=LENGTHS, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    return sequences, torch.cat(sequences), positions, cu_seqlens


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_packed_forward_matches_transformers(tmp_path, family, backend):
    hf_model = random_hf_model(family)
    hf_model.save_pretrained(tmp_path)
    ours = load_hf(tmp_path, attention=backend)
    assert ours.args.family == family
    assert (ours.args.rope_scaling is not None) == (family == "llama")

    sequences, ids, positions, cu_seqlens = packed_batch(1000)
    with torch.no_grad():
        hidden = ours(ids, positions, cu_seqlens)
        logits = hidden @ ours.lm_head_weight.T
        ref_hidden = torch.cat([hf_model.model(s[None]).last_hidden_state[0] for s in sequences])
        ref_logits = torch.cat([hf_model(s[None]).logits[0] for s in sequences])

    assert hidden.shape == (sum(LENGTHS), 96)
    assert (hidden - ref_hidden).abs().max().item() <= TOLERANCE
    assert (logits - ref_logits).abs().max().item() <= TOLERANCE
