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
"""

from __future__ import annotations

import math

import torch

from rlmtrain.config import Config


def build_optimizer(model: torch.nn.Module, cfg: Config, phase: str) -> torch.optim.AdamW:
    """A fresh AdamW for `phase` ("sft" | "rl"): its peak LR and its epsilon."""
    train = cfg.train
    beta1, beta2 = train.adam_betas
    return torch.optim.AdamW(
        model.parameters(),
        lr=phase_peak_lr(cfg, phase),
        betas=(beta1, beta2),
        eps=phase_adam_eps(cfg, phase),
        weight_decay=train.weight_decay,
        fused=train.adam_fused,
    )


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
