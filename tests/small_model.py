"""The small Qwen3-shaped model the KV-cache tests share (`test_model_kv_cache`,
`test_prefix_cache`, `test_batch_invariance`): two layers, 4 query heads over 2 KV heads of 16
dims, a 200-token vocabulary."""

from __future__ import annotations

from rlmtrain.model import ModelArgs, Transformer

ARGS = ModelArgs(
    family="qwen3",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
    qk_norm=True,
    tie_word_embeddings=True,
)


def make_model(attention: str = "sdpa") -> Transformer:
    model = Transformer(ARGS, attention=attention)
    # A wide init makes logits peaked, so greedy choices are not decided by rounding noise.
    model.init_weights(seed=0, std=0.5)
    return model.eval()
