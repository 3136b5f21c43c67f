"""Gradient clipping: one rule per mode, each a dataclass in its own file, built from `clip._target_`.

    python train.py clip=agc clip.factor=0.02      # conf/clip/agc.yaml: _target_ and the mode's options

`build_clip(cfg.clip)` builds and checks a rule; `plan_clip(parameters, rule)` computes the total gradient norm
before clipping (a tensor on the gradients' device) and the rule's plan, with no host synchronisation: a device flag
saying whether clipping will change any gradient, and `apply()`. The guard reads the flag in its one sync and
applies the plan only to a step it takes. `clip_gradients(parameters, "norm", max_norm=1.0)` is the keyword form
for a loop of one's own.
"""

import dataclasses
from collections.abc import Iterable

import torch
from omegaconf import OmegaConf
from torch.nn.utils import get_total_norm

from wapstable.errors import UserError
from wapstable.stability.clip.autoclip import AutoClip, AutoClipHistory
from wapstable.stability.clip.base import ClipPlan, ClipRule, no_plan
from wapstable.targets import classes_in, import_class, typed_options

__all__ = [
    "AutoClip",
    "AutoClipHistory",
    "ClipPlan",
    "ClipRule",
    "build_clip",
    "builtin_rules",
    "clip_gradients",
    "clip_gradients_",
    "grad_norm",
    "legacy_clip",
    "plan_clip",
    "rule_for",
]


def builtin_rules() -> dict[str, type]:
    """The clip rules of this package by name, found in its modules (a new file is found without an edit here)."""
    return {cls.name: cls for cls in classes_in(__name__, __path__, ClipRule)}


def option_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def rule_class(target: str) -> type:
    """The class `clip._target_` names; a UserError in one sentence when it is not a clip rule."""
    hint = "name a clip rule on the Python path, or choose one of clip={" + ",".join(builtin_rules()) + "}"
    cls = import_class(target, "clip", hint)
    if not (dataclasses.is_dataclass(cls) and callable(getattr(cls, "plan", None))):
        raise UserError(
            f"clip._target_={target} is not a clip rule: it must be a dataclass with a plan() method (subclass "
            "wapstable.stability.clip.ClipRule)"
        )
    return cls


def build_clip(cfg_clip) -> ClipRule:
    """The rule `cfg.clip` names by `_target_`, its options typed and checked (one sentence naming the key)."""
    given = OmegaConf.to_container(OmegaConf.create(dict(cfg_clip)), resolve=True)
    target = given.pop("_target_", None)
    if not target:
        raise UserError(
            "clip names no rule: give it a _target_ (a clip rule class, as conf/clip/norm.yaml does), or choose one "
            "of clip={" + ",".join(builtin_rules()) + "}"
        )
    cls = rule_class(target)
    return typed_options(cls, given, "clip", f"conf/clip/{getattr(cls, 'name', target)}.yaml")


def legacy_clip(saved: dict) -> dict:
    """A checkpoint's `clip` from before the rules were `_target_`s (`{mode: norm, max_norm: ..., value: ...}`,
    every mode's keys in one): the rule that mode names, with the keys it takes."""
    if not isinstance(saved, dict) or "_target_" in saved or "mode" not in saved:
        return saved
    cls = builtin_rules()[str(saved["mode"])]
    keys = option_names(cls)
    return {
        "_target_": f"{cls.__module__}.{cls.__qualname__}",
        **{k: v for k, v in saved.items() if k in keys},
    }


def rule_for(mode: str | ClipRule, *, skip=(), history: AutoClipHistory | None = None, **options) -> ClipRule:
    """The keyword form: a rule by mode name and the options it takes, picked from `options` (the others are
    ignored, as `clip_gradients` always did). `skip`: parameters AGC leaves alone; `history`: AutoClip's norms."""
    if isinstance(mode, ClipRule):
        return mode
    rules = builtin_rules()
    if mode not in rules:
        raise UserError(f"clip mode {mode!r} is unknown; use one of {', '.join(rules)}")
    cls = rules[mode]
    rule = cls(**{k: v for k, v in options.items() if k in option_names(cls)})
    if skip and hasattr(rule, "leave_alone"):
        rule.leave_alone(skip)
    if history is not None and isinstance(rule, AutoClip):
        rule.norms = history
    return rule


def grads_of(parameters: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [p for p in parameters if p.grad is not None]
    return params, [p.grad for p in params]


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total norm of all gradients, as `clip_grad_norm_` computes it (foreach, on the device)."""
    _, grads = grads_of(parameters)
    if not grads:
        return torch.tensor(0.0)
    return get_total_norm(grads, norm_type=norm_type, foreach=None)


def plan_clip(
    parameters: Iterable[torch.Tensor], rule: ClipRule, total_norm: torch.Tensor | None = None
) -> tuple[torch.Tensor, ClipPlan]:
    """The total norm in the rule's norm (computed unless given) and its plan; nothing changes before `apply()`."""
    params, grads = grads_of(parameters)
    if not grads:
        zero = torch.tensor(0.0)
        return zero, no_plan()
    if total_norm is None:
        total_norm = get_total_norm(grads, norm_type=rule.norm_type)
    return total_norm, rule.plan(params, grads, total_norm)


def clip_gradients_(
    parameters: Iterable[torch.Tensor],
    mode: str | ClipRule,
    total_norm: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip in place; returns (total norm before clipping, flag: did clipping change a gradient)."""
    total_norm, plan = plan_clip(parameters, rule_for(mode, **options), total_norm)
    plan.apply()
    return total_norm, plan.flag


def clip_gradients(parameters: Iterable[torch.Tensor], mode: str | ClipRule, **options) -> torch.Tensor:
    """Clip the gradients of `parameters` by a rule or a mode's name (none, norm, value, inf, agc, autoclip).

    Options: max_norm, norm_type (norm); value (value); max_norm (inf); factor, eps, skip (agc: parameters left
    alone, e.g. the output layer); percentile, history (autoclip: an AutoClipHistory). Returns the total norm before
    clipping (the `norm_type` norm for norm, the infinity norm for inf, the 2-norm otherwise), as a tensor.
    """
    return clip_gradients_(parameters, mode, **options)[0]
