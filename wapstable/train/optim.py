"""Optimizers (`optim._target_`, built by Hydra's `instantiate`) and learning-rate schedules (`optim.schedule`, one
module each in wapstable/train/schedules/: a LambdaLR over `lr_factor`, which a rollback's back-off rescales)."""

import importlib
import inspect
from collections.abc import Callable

import torch
from hydra.utils import instantiate

from wapstable.errors import UserError
from wapstable.train.schedules import build_schedule

# The OptimConfig keys an optimizer may take, passed to its constructor when its signature has them.
OPTIMIZER_ARGS = ("lr", "rho", "eps", "weight_decay", "betas", "momentum")


def build_optimizer(cfg_optim, params) -> torch.optim.Optimizer:
    """The optimizer class of `optim._target_` (torch.optim.Adadelta, WAP's, by default), built with the keys of
    `optim` that its constructor takes: any `torch.optim` class, or a class of your own, plugs in from the config."""
    if cfg_optim.lr <= 0:
        raise UserError(f"optim.lr={cfg_optim.lr} must be positive")
    target = cfg_optim._target_
    module, _, name = target.rpartition(".")
    try:  # found here, not by instantiate, so that a wrong name is one sentence rather than Hydra's log lines
        cls = getattr(importlib.import_module(module), name)
        accepted = inspect.signature(cls).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        raise UserError(
            f"optim._target_={target} is not an importable optimizer class; use e.g. torch.optim.Adam"
        ) from None
    args = {k: cfg_optim[k] for k in OPTIMIZER_ARGS if k in accepted}
    if "betas" in args:
        args["betas"] = tuple(args["betas"])
    return instantiate({"_target_": target, "_partial_": True, **args})(params)


def lr_factor(cfg_optim, step: int, max_steps: int, time_done: float = 0.0, schedule=None) -> float:
    """The multiplier of the base lr at `step`: linear warm-up (optim.warmup_steps), then `optim.schedule`'s factor
    (wapstable/train/schedules/; `schedule`: that schedule, built already).

    `time_done` is the share of a wall-clock budget (trainer.max_minutes) already spent: the cosine follows
    whichever of steps and time runs out first, so a time-limited run still ends its schedule at the minimum.
    """
    if step < cfg_optim.warmup_steps:
        return (step + 1) / cfg_optim.warmup_steps
    return (schedule or build_schedule(cfg_optim)).factor(step, max_steps, time_done)


def build_scheduler(
    cfg_optim, optimizer, max_steps: int, time_done: Callable[[], float] | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor; `time_done()` gives the share of the wall-clock budget spent (None: no budget)."""
    schedule = build_schedule(cfg_optim)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(cfg_optim, step, max_steps, time_done() if time_done else 0.0, schedule),
    )
