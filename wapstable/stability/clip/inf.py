"""`clip=inf`: infinity-norm clipping: the largest absolute gradient is scaled down to `clip.max_norm`, every
gradient by the same factor (the gradient-explosion example: a linear layer fed inputs like 120 and -200)."""

from dataclasses import dataclass

from torch.nn.utils import clip_grads_with_norm_

from wapstable.stability.clip.base import ClipPlan, ClipRule


@dataclass
class InfNormClip(ClipRule):
    max_norm: float = 1.0

    name = "inf"
    threshold_key = "max_norm"
    norm_type = float("inf")

    def __post_init__(self):
        self.positive("max_norm")

    def plan(self, params, grads, total_norm) -> ClipPlan:
        max_norm = self.max_norm
        return ClipPlan(total_norm > max_norm, lambda: clip_grads_with_norm_(params, max_norm, total_norm))

    def threshold(self) -> float:
        return float(self.max_norm)
