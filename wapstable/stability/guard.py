"""The step guard: decides whether an optimizer step is taken, and keeps the skip budget.

A step is skipped when the loss or any gradient is NaN/Inf (`guard.skip_nonfinite`) or, optionally, when the loss
or grad norm is a spike against a rolling window (`guard.skip_spikes`, as OLMo-core does). A skipped step calls
neither the optimizer nor the scheduler, so weights, moments, step counters, the lr schedule and the grad-norm
history stay bit-identical; the gradients are zeroed. The decision needs one host synchronisation per step (the
finite flag, read together with the loss and norm that are logged anyway).
"""

import math
from collections import deque

import torch


def nonfinite_flag(loss: torch.Tensor, total_norm: torch.Tensor) -> torch.Tensor:
    """A device bool: is the loss or the total gradient norm NaN/Inf? (A norm is finite iff every gradient is.)"""
    return ~(torch.isfinite(loss.detach()) & torch.isfinite(total_norm))


def count_nonfinite_grads(named_parameters) -> tuple[int, dict[str, int]]:
    """How many gradient tensors hold NaN/Inf, and the count of bad values per parameter name."""
    per_layer = {}
    for name, p in named_parameters:
        if p.grad is not None:
            bad = int((~torch.isfinite(p.grad)).sum())
            if bad:
                per_layer[name] = bad
    return len(per_layer), per_layer


def grad_figures(model) -> tuple[dict[str, float], dict[str, int]]:
    """Per parameter: the gradient's 2-norm, and the count of its non-finite values (only those with any), for
    an anomaly checkpoint."""
    norms = {
        n: float(p.grad.detach().float().norm()) for n, p in model.named_parameters() if p.grad is not None
    }
    return norms, count_nonfinite_grads(model.named_parameters())[1]


class SpikeDetector:
    """Z-score of the loss and the grad norm against the last `window` accepted steps (OLMo-core's rule)."""

    def __init__(self, window: int = 128, zscore: float = 6.0, warmup: int = 32):
        self.window, self.zscore, self.warmup = window, zscore, warmup
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)

    @staticmethod
    def _z(history: deque, x: float) -> float:
        n = len(history)
        mean = sum(history) / n
        std = math.sqrt(sum((h - mean) ** 2 for h in history) / max(1, n - 1))
        return (x - mean) / max(std, 1e-12)

    def check(self, loss: float, norm: float) -> str | None:
        """The reason this step is a spike ("loss spike (z=...)"), or None."""
        if len(self.losses) < self.warmup:
            return None
        z_loss, z_norm = self._z(self.losses, loss), self._z(self.norms, norm)
        if z_loss > self.zscore:
            return f"loss spike (loss {loss:.4g}, z={z_loss:.1f})"
        if z_norm > self.zscore:
            return f"grad-norm spike (norm {norm:.4g}, z={z_norm:.1f})"
        return None

    def update(self, loss: float, norm: float) -> None:
        self.losses.append(loss)
        self.norms.append(norm)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.window)
        self.norms = deque(state["norms"], maxlen=self.window)


class SkipBudget:
    """Counts skipped steps; past `max_consecutive` in a row or `max_total` in all, the run must stop."""

    def __init__(self, max_consecutive: int, max_total: int):
        self.max_consecutive, self.max_total = max_consecutive, max_total
        self.consecutive = self.total = self.nonfinite = self.spikes = 0

    def record(self, skipped: bool, spike: bool = False) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        self.spikes += spike
        self.nonfinite += not spike

    def exhausted(self) -> str | None:
        """Why the budget is spent, or None."""
        if self.consecutive > self.max_consecutive:
            return f"{self.consecutive} consecutive skipped steps exceed guard.max_consecutive_skips={self.max_consecutive}"
        if self.total > self.max_total:
            return f"{self.total} skipped steps exceed guard.max_total_skips={self.max_total}"
        return None

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("consecutive", "total", "nonfinite", "spikes")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, int(v))
