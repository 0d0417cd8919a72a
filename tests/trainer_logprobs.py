"""What the trainer computes for a sampled completion: the reference an engine's log-probs are
checked against (`test_engine_native`, `test_engine_vllm`)."""

from __future__ import annotations

import torch

from rlmtrain.kernels import fused_linear_logprob


@torch.no_grad()
def completion_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """`fused_linear_logprob` of each completion token over the packed forward of the whole
    sequence, at `temperature`."""
    ids = torch.tensor(prompt + completion)
    hidden = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]))
    positions = torch.arange(len(prompt) - 1, len(ids) - 1)
    return fused_linear_logprob(
        hidden[positions], model.lm_head_weight, ids[positions + 1], temperature=temperature,
        impl="torch",
    )  # fmt: skip
