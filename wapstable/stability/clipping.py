"""Gradient clipping: one dispatch point (`clip_gradients`), one short function per mode.

Every mode first plans (`plan_clip`): the total gradient norm *before* clipping, as a tensor on the gradients'
device, and a device flag saying whether clipping will change any gradient, with no host synchronisation; then
`apply()` clips. The guard reads the flag in its one sync and applies the plan only to a step it takes.
"""

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from wapstable.errors import UserError

Tensors = list[torch.Tensor]


def _grads(parameters: Iterable[torch.Tensor]) -> tuple[Tensors, Tensors]:
    params = [p for p in parameters if p.grad is not None]
    return params, [p.grad for p in params]


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total norm of all gradients, as `clip_grad_norm_` computes it (foreach, on the device)."""
    _, grads = _grads(parameters)
    if not grads:
        return torch.tensor(0.0)
    return get_total_norm(grads, norm_type=norm_type, foreach=None)


class AutoClipHistory:
    """The run's grad-norm history for AutoClip, kept on the device as a ring buffer (no host sync)."""

    def __init__(self, size: int = 10000):
        self.size = size
        self.buffer = torch.zeros(size)
        self.count = 0  # norms seen so far; the buffer holds the last min(count, size)

    def append(self, norm: torch.Tensor) -> None:
        if self.buffer.device != norm.device:
            self.buffer = self.buffer.to(norm.device)
        self.buffer[self.count % self.size] = norm.detach().float()
        self.count += 1

    def percentile(self, p: float, including: torch.Tensor | None = None) -> torch.Tensor:
        """The p-th percentile (linear interpolation, as numpy.percentile) of the norms seen so far, and of
        `including` as if it had been appended (the buffer itself is left as it is)."""
        buffer, count = self.buffer, self.count
        if including is not None:
            if buffer.device != including.device:
                buffer = buffer.to(including.device)
            buffer = buffer.clone()
            buffer[count % self.size] = including.detach().float()
            count += 1
        return torch.quantile(buffer[: min(count, self.size)], p / 100.0)

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.cpu().clone(), "count": self.count, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        self.size, self.count = int(state["size"]), int(state["count"])
        self.buffer = state["buffer"].clone()


class ClipPlan(NamedTuple):
    """A mode's decision, computed before the guard's one host sync, and the clipping to do if the step is taken.

    `flag` (a device bool: will clipping change a gradient) is read together with the finite flag, so knowing
    whether a step was clipped costs no second sync; `apply()` clips in place and touches no state before it runs,
    so a skipped step leaves the gradients as backward made them (for the anomaly checkpoint's per-layer figures)
    and the AutoClip history unchanged.
    """

    flag: torch.Tensor
    apply: Callable[[], None]


def _plan_none(params, grads, total_norm, **_):
    return ClipPlan(torch.zeros((), dtype=torch.bool, device=total_norm.device), lambda: None)


def _plan_norm(params, grads, total_norm, max_norm: float, norm_type: float = 2.0, **_):
    """Global-norm clipping, exactly `torch.nn.utils.clip_grad_norm_` (Pascanu et al. 2013)."""
    return ClipPlan(total_norm > max_norm, lambda: clip_grads_with_norm_(params, max_norm, total_norm))


def _plan_value(params, grads, total_norm, value: float, **_):
    """Elementwise clamp to +-value, exactly `torch.nn.utils.clip_grad_value_`."""
    largest = get_total_norm(grads, norm_type=float("inf"))
    return ClipPlan(largest > value, lambda: torch.nn.utils.clip_grad_value_(params, value))


def _unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    # Per output unit: rows of a Linear weight, output channels of a conv; biases and gains elementwise.
    if x.ndim <= 1:
        return x.abs()
    return x.norm(p=2, dim=tuple(range(1, x.ndim)), keepdim=True)


def _plan_agc(params, grads, total_norm, factor: float = 0.01, eps: float = 1e-3, skip=(), **_):
    """Adaptive gradient clipping (Brock et al. 2021, "High-Performance Large-Scale Image Recognition Without
    Normalization"): per unit, if |G|/max(|W|, eps) > factor, rescale G to factor*max(|W|, eps)."""
    skip_ids = {id(p) for p in skip}
    clipped = torch.zeros((), dtype=torch.bool, device=total_norm.device)
    scales = []
    for p, g in zip(params, grads):
        if id(p) in skip_ids:
            continue
        max_norm = _unitwise_norm(p.detach()).clamp_min(eps) * factor
        g_norm = _unitwise_norm(g)
        over = g_norm > max_norm
        scales.append((g, torch.where(over, max_norm / g_norm.clamp_min(1e-6), torch.ones_like(g_norm))))
        clipped |= over.any()

    def apply():
        for g, scale in scales:
            g.mul_(scale)

    return ClipPlan(clipped, apply)


def _plan_autoclip(
    params, grads, total_norm, percentile: float = 10.0, history: AutoClipHistory | None = None, **_
):
    """AutoClip (Seetharaman et al. 2020): clip the global norm to the p-th percentile of all norms seen so far,
    this step's included (it joins the history only if the step is taken)."""
    assert history is not None, "autoclip needs a history"
    threshold = history.percentile(percentile, including=total_norm)

    def apply():
        history.append(total_norm)
        clip_grads_with_norm_(params, threshold, total_norm)

    return ClipPlan(total_norm > threshold, apply)


CLIP_MODES: dict[str, Callable[..., ClipPlan]] = {
    "none": _plan_none,
    "norm": _plan_norm,
    "value": _plan_value,
    "inf": lambda params, grads, total_norm, max_norm, **kw: _plan_norm(params, grads, total_norm, max_norm),
    "agc": _plan_agc,
    "autoclip": _plan_autoclip,
}


def mode_norm_type(mode: str, norm_type: float = 2.0) -> float:
    """The norm a mode measures: inf for `inf`, `norm_type` for `norm`, 2 otherwise."""
    return float("inf") if mode == "inf" else float(norm_type) if mode == "norm" else 2.0


def plan_clip(
    parameters: Iterable[torch.Tensor], mode: str, total_norm: torch.Tensor | None = None, **options
) -> tuple[torch.Tensor, ClipPlan]:
    """The total norm (computed unless given) and the mode's plan; nothing is changed until `plan.apply()`."""
    if mode not in CLIP_MODES:
        raise UserError(f"clip.mode={mode!r} is unknown; use one of {', '.join(CLIP_MODES)}")
    params, grads = _grads(parameters)
    if not grads:
        zero = torch.tensor(0.0)
        return zero, ClipPlan(zero > 0, lambda: None)
    if total_norm is None:
        total_norm = get_total_norm(grads, norm_type=mode_norm_type(mode, options.get("norm_type", 2.0)))
    return total_norm, CLIP_MODES[mode](params, grads, total_norm, **options)


def clip_gradients_(
    parameters: Iterable[torch.Tensor], mode: str, total_norm: torch.Tensor | None = None, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip in place; returns (total norm before clipping, flag: did clipping change a gradient)."""
    total_norm, plan = plan_clip(parameters, mode, total_norm, **options)
    plan.apply()
    return total_norm, plan.flag


def clip_gradients(parameters: Iterable[torch.Tensor], mode: str, **options) -> torch.Tensor:
    """Clip the gradients of `parameters` by `mode` (none, norm, value, inf, agc, autoclip).

    Options: max_norm, norm_type (norm); value (value); max_norm (inf); factor, eps, skip (agc: parameters left
    alone, e.g. the output layer); percentile, history (autoclip). Returns the total norm before clipping (the
    `norm_type` norm for norm, the infinity norm for inf, the 2-norm otherwise), as a tensor.
    """
    return clip_gradients_(parameters, mode, **options)[0]


def validate_clip_config(cfg_clip) -> None:
    """Fail before training on a threshold that cannot work, naming the key."""
    mode = cfg_clip.mode  # one of CLIP_MODES: the schema's ClipMode Enum
    checks = {
        "norm": [("max_norm", cfg_clip.max_norm)],
        "inf": [("max_norm", cfg_clip.max_norm)],
        "value": [("value", cfg_clip.value)],
        "agc": [("factor", cfg_clip.factor), ("eps", cfg_clip.eps)],
        "autoclip": [("history", cfg_clip.history)],
    }.get(mode, [])
    for key, val in checks:
        if not val > 0:
            raise UserError(f"clip.{key}={val} must be positive for clip={mode}")
    if mode == "norm" and cfg_clip.norm_type not in (1.0, 2.0):
        raise UserError(f"clip.norm_type={cfg_clip.norm_type} is not supported; use 1 or 2 (or clip=inf)")
    if mode == "autoclip" and not 0 < cfg_clip.percentile <= 100:
        raise UserError(f"clip.percentile={cfg_clip.percentile} must lie in (0, 100]")


# The option each mode's threshold lives in, which a rollback tightens by guard.clip_backoff.
THRESHOLD_KEY = {
    "norm": "max_norm",
    "inf": "max_norm",
    "value": "value",
    "agc": "factor",
    "autoclip": "percentile",
}


def mode_options(
    mode: str,
    *,
    max_norm: float = 1.0,
    norm_type: float = 2.0,
    value: float = 1.0,
    factor: float = 0.01,
    eps: float = 1e-3,
    skip=(),
    percentile: float = 10.0,
    history: AutoClipHistory | None = None,
) -> dict:
    """The keyword options of `plan_clip`/`clip_gradients_` that clip mode `mode` takes, picked from all of them."""
    if mode not in CLIP_MODES:
        raise UserError(f"clip.mode={mode!r} is unknown; use one of {', '.join(CLIP_MODES)}")
    if mode in ("norm", "inf"):
        return {"max_norm": max_norm, "norm_type": mode_norm_type(mode, norm_type)}
    if mode == "value":
        return {"value": value}
    if mode == "agc":
        return {"factor": factor, "eps": eps, "skip": skip}
    if mode == "autoclip":
        return {"percentile": percentile, "history": history}
    return {}


def clip_options(cfg_clip, history: AutoClipHistory | None, skip=(), scale: float = 1.0) -> dict:
    """The keyword options of `clip_gradients_` for a `clip` config, its threshold multiplied by `scale`."""
    c = cfg_clip
    opts = mode_options(
        c.mode,
        max_norm=c.max_norm,
        norm_type=c.norm_type,
        value=c.value,
        factor=c.factor,
        eps=c.eps,
        skip=skip,
        percentile=c.percentile,
        history=history,
    )
    if c.mode in THRESHOLD_KEY:
        opts[THRESHOLD_KEY[c.mode]] *= scale
    return opts


def scaled_threshold(cfg_clip, scale: float = 1.0) -> float | None:
    """The configured threshold of the clip mode after a rollback's back-off (None for clip=none)."""
    key = THRESHOLD_KEY.get(cfg_clip.mode)
    return None if key is None else float(cfg_clip[key]) * scale
