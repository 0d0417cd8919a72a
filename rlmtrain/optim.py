"""The optimizer and its learning-rate schedule, from `[train]`.

AdamW over the fp32 master weights (`train.adam_betas`, `adam_eps`, `adam_fused`,
`weight_decay`); each phase starts an AdamW of its own, SFT with `sft_adam_eps` where set. The
LR is a pure function of the phase and the step (`lr_at`), so a resumed run needs only the step
to be back on schedule; the value in force is still written into every checkpoint and metrics
row. Each phase (SFT at `train.sft_lr`, RL at `train.lr`) has its own schedule over its own
steps: `warmup_steps` of linear warm-up from peak / (warmup + 1), then the peak held
("constant") or decayed to `min_lr_ratio` x peak at the phase's last step ("linear",
"cosine"). `sft_lr_schedule` gives SFT a schedule of its own: a supervised phase that decays its
LR settles instead of spiking at a high constant one, while RL keeps a constant LR;
`sft_warmup_steps` likewise gives SFT a warm-up of its own, so RL's first updates (on a fresh
AdamW whose second moments are one batch old) can ramp up while SFT keeps its start.

`train.optimizer_offload` keeps AdamW's two moments, 8 of the 16 bytes a parameter of a rank's
model states, in host memory (`HostAdamW`): the step brings one parameter's moments to the
device at a time, updates them with torch's own AdamW kernel, and writes them back, so the card
holds the masters and gradients and, for the step, one parameter's moments.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from rlmtrain.config import Config
from rlmtrain.parallel import local_shard


def build_optimizer(model: torch.nn.Module, cfg: Config, phase: str) -> torch.optim.Optimizer:
    """A fresh AdamW for `phase` ("sft" | "rl"): its peak LR and its epsilon; its moments in
    host memory with `train.optimizer_offload`."""
    train = cfg.train
    beta1, beta2 = train.adam_betas
    kind = HostAdamW if train.optimizer_offload else torch.optim.AdamW
    return kind(
        model.parameters(),
        lr=phase_peak_lr(cfg, phase),
        betas=(beta1, beta2),
        eps=phase_adam_eps(cfg, phase),
        weight_decay=train.weight_decay,
        fused=train.adam_fused,
    )


class HostAdamW(torch.optim.Optimizer):
    """AdamW with its two moments in host memory, pinned when the parameters are on CUDA.

    Each step goes parameter by parameter: the moments are copied to the parameter's device,
    updated with the parameter by torch's AdamW (`torch.optim.adam.adam` with decoupled weight
    decay; fused as `fused` says, else multi-tensor on CUDA and single-tensor elsewhere, the
    choice `torch.optim.AdamW` makes by default, so the numbers are its numbers), and copied
    back. The state and the param groups keep torch AdamW's keys, so a checkpoint of either
    resumes into the other; for a sharded parameter the moments are DTensors of the parameter's
    layout over host memory, so the DCP checkpoint saves and reshards them as it does AdamW's,
    and loading a state dict keeps them on the host (torch's loader would first cast them all to
    the parameters' device)."""

    def __init__(self, params, *, lr, betas, eps, weight_decay, fused=False):
        adamw = dict(amsgrad=False, maximize=False, foreach=None, capturable=False)
        adamw |= dict(differentiable=False, decoupled_weight_decay=True)
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused) | adamw,
        )
        self.register_load_state_dict_pre_hook(_hide_moments)
        self.register_load_state_dict_post_hook(_moments_on_host)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure")
        on_cuda = False
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                local = local_shard(param)
                on_cuda |= local.is_cuda
                state = self.state[param]
                if not state:
                    # torch keeps the step count on the device for its fused kernel, else on
                    # the CPU, as a float32 scalar: the same layout checkpoints the same way.
                    where = local.device if group["fused"] else torch.device("cpu")
                    state["step"] = torch.zeros((), dtype=torch.float32, device=where)
                    state.update({key: _host_zeros_like(param) for key in MOMENTS})
                moments = [local_shard(state[key]) for key in MOMENTS]
                on_device = [m.to(local.device, non_blocking=True) for m in moments]
                adam(
                    [local],
                    [local_shard(param.grad)],
                    [on_device[0]],
                    [on_device[1]],
                    [],
                    [state["step"]],
                    foreach=local.is_cuda and not group["fused"],
                    fused=group["fused"],
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                for host, updated in zip(moments, on_device, strict=True):
                    if host is not updated:
                        host.copy_(updated, non_blocking=True)
        if on_cuda:
            # The copies back to pinned memory are asynchronous: the host must not read the
            # moments (a checkpoint) before they land.
            torch.cuda.current_stream().synchronize()


MOMENTS = ("exp_avg", "exp_avg_sq")
"""torch AdamW's state keys of the two moments, the tensors HostAdamW keeps in host memory."""


def _host_zeros_like(param: torch.Tensor) -> torch.Tensor:
    local = local_shard(param)
    host = torch.zeros(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
    if isinstance(param, DTensor):
        # DTensor.from_local would move the host tensor to the mesh's device; FSDP2 builds its
        # own CPU-offloaded shards the same way, from the local tensor and the layout.
        return DTensor(host, param._spec, requires_grad=False)
    return host


class _Moment:
    """A moment passed through `Optimizer.load_state_dict` untouched: its cast handles tensors
    and iterables, and would copy every moment to the device first."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _hide_moments(optimizer: HostAdamW, state_dict: dict) -> dict:
    state = {
        index: {k: _Moment(v) if k in MOMENTS else v for k, v in s.items()}
        for index, s in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def _moments_on_host(optimizer: HostAdamW) -> None:
    for param, state in optimizer.state.items():
        for key in MOMENTS:
            moment = state.get(key)
            if isinstance(moment, _Moment):
                moment = moment.tensor
            held = local_shard(moment)
            # A DCP load fills the host tensors this optimizer made: kept as they are. Anything
            # else (another optimizer's state dict) is copied into a host tensor of its own.
            if held.device.type != "cpu" or held.is_pinned() != local_shard(param).is_cuda:
                host = _host_zeros_like(param)
                local_shard(host).copy_(held)
                moment = host
            state[key] = moment


def phase_peak_lr(cfg: Config, phase: str) -> float:
    if phase == "sft":
        return cfg.train.sft_lr or cfg.train.lr
    return cfg.train.lr


def phase_adam_eps(cfg: Config, phase: str) -> float:
    if phase == "sft":
        return cfg.train.sft_adam_eps or cfg.train.adam_eps
    return cfg.train.adam_eps


def phase_schedule(cfg: Config, phase: str) -> str:
    if phase == "sft" and cfg.train.sft_lr_schedule != "same":
        return cfg.train.sft_lr_schedule
    return cfg.train.lr_schedule


def phase_steps(cfg: Config, phase: str) -> int:
    return cfg.train.sft_steps if phase == "sft" else cfg.train.steps


def warmup_within(asked: int, steps: int) -> int:
    """A warm-up of `asked` steps in a phase of `steps`: at most all its steps but the last, so
    a run shortened below a config's warm-up still ends each phase at its peak."""
    return min(asked, max(steps - 1, 0))


def phase_warmup(cfg: Config, phase: str) -> int:
    asked = cfg.train.warmup_steps
    if phase == "sft" and cfg.train.sft_warmup_steps >= 0:
        asked = cfg.train.sft_warmup_steps
    return warmup_within(asked, phase_steps(cfg, phase))


def lr_at(cfg: Config, phase: str, step: int) -> float:
    """The LR of 0-based `step` of `phase` ("sft" | "rl")."""
    train = cfg.train
    peak = phase_peak_lr(cfg, phase)
    steps = phase_steps(cfg, phase)
    warmup = phase_warmup(cfg, phase)
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    schedule = phase_schedule(cfg, phase)
    if schedule == "constant":
        return peak
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = train.min_lr_ratio * peak
    if schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
