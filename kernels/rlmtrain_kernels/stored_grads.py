"""The fused losses' backward: the gradients their forward already formed, in fp32, scaled by the
upstream gradient of the loss."""

from __future__ import annotations

import torch

__all__ = ["scaled_grad"]


def scaled_grad(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad * scale in `dtype`, in one pass: the product is rounded as it is written. A
    multiply, then a cast, writes and reads the fp32 dW once more; on an H200 the two took
    1.9 ms of the GRPO loss's 65 at V = 151936, H = 2560 (bench/gpu/NOTES.md, run 4). An `out=`
    product records no graph: a backward that is itself differentiated does not come here
    (`second_order`)."""
    return torch.mul(grad, scale, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))
