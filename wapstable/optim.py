"""Optimizers and learning-rate schedules: one dispatch point each."""

import math
from collections.abc import Callable

import torch

from .errors import UserError


def build_optimizer(cfg_optim, params) -> torch.optim.Optimizer:
    """The optimizer named by `optim.name`: adadelta (WAP's), adam or sgd."""
    if cfg_optim.lr <= 0:
        raise UserError(f"optim.lr={cfg_optim.lr} must be positive")
    name = cfg_optim.name
    if name == "adadelta":
        return torch.optim.Adadelta(
            params, lr=cfg_optim.lr, rho=cfg_optim.rho, eps=cfg_optim.eps, weight_decay=cfg_optim.weight_decay
        )
    if name == "adam":
        return torch.optim.Adam(
            params,
            lr=cfg_optim.lr,
            betas=tuple(cfg_optim.betas),
            eps=cfg_optim.eps,
            weight_decay=cfg_optim.weight_decay,
        )
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg_optim.lr, momentum=cfg_optim.momentum, weight_decay=cfg_optim.weight_decay
        )
    raise UserError(f"optim.name={name!r} is unknown; use optim=adadelta, adam or sgd")


def lr_factor(cfg_optim, step: int, max_steps: int, time_done: float = 0.0) -> float:
    """The multiplier of the base lr at `step`: linear warm-up, then constant, cosine or step decay.

    `time_done` is the share of a wall-clock budget (trainer.max_minutes) already spent: the cosine follows
    whichever of steps and time runs out first, so a time-limited run still ends its schedule at the minimum.
    """
    if step < cfg_optim.warmup_steps:
        return (step + 1) / cfg_optim.warmup_steps
    if cfg_optim.schedule == "constant":
        return 1.0
    if cfg_optim.schedule == "cosine":
        span = max(1, max_steps - cfg_optim.warmup_steps)
        progress = min(1.0, max((step - cfg_optim.warmup_steps) / span, time_done))
        floor = cfg_optim.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg_optim.schedule == "step":
        return cfg_optim.gamma ** (step // cfg_optim.step_size)
    raise UserError(f"optim.schedule={cfg_optim.schedule!r} is unknown; use constant, cosine or step")


def build_scheduler(
    cfg_optim, optimizer, max_steps: int, time_done: Callable[[], float] | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor; `time_done()` gives the share of the wall-clock budget spent (None: no budget)."""
    lr_factor(cfg_optim, 0, max_steps)  # fail fast on a bad schedule name
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg_optim, step, max_steps, time_done() if time_done else 0.0)
    )
