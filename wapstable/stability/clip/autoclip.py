"""`clip=autoclip`: AutoClip (Seetharaman et al. 2020): the global norm is clipped to the `clip.percentile`-th
percentile of every norm seen so far, this step's included (it joins the history only if the step is taken). The
history is the rule's state: it goes into every checkpoint and comes back on resume and rollback."""

from dataclasses import dataclass

import torch
from torch.nn.utils import clip_grads_with_norm_

from wapstable.errors import UserError
from wapstable.stability.clip.base import ClipPlan, ClipRule


class AutoClipHistory:
    """The run's grad-norm history, kept on the device as a ring buffer (no host sync)."""

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


@dataclass
class AutoClip(ClipRule):
    percentile: float = 10.0
    history: int = 10000  # grad norms kept

    name = "autoclip"
    threshold_key = "percentile"

    def __post_init__(self):
        self.positive("history")
        if not 0 < self.percentile <= 100:
            raise UserError(f"clip.percentile={self.percentile} must lie in (0, 100]")
        self.norms = AutoClipHistory(self.history)

    def plan(self, params, grads, total_norm) -> ClipPlan:
        threshold = self.norms.percentile(self.percentile, including=total_norm)
        history = self.norms

        def apply():
            history.append(total_norm)
            clip_grads_with_norm_(params, threshold, total_norm)

        return ClipPlan(total_norm > threshold, apply)

    def threshold(self) -> float | None:
        """The current percentile of the history (a host sync); None before the first norm."""
        return float(self.norms.percentile(self.percentile)) if self.norms.count else None

    def state_dict(self) -> dict:
        return {"history": self.norms.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("history") is not None:
            self.norms.load_state_dict(state["history"])
