"""`clip=norm`: global-norm clipping, exactly `torch.nn.utils.clip_grad_norm_` (Pascanu et al. 2013)."""

from dataclasses import dataclass

from torch.nn.utils import clip_grads_with_norm_

from wapstable.errors import UserError
from wapstable.stability.clip.base import ClipPlan, ClipRule


@dataclass
class NormClip(ClipRule):
    max_norm: float = 100.0
    norm_type: float = 2.0  # 1 or 2; the infinity norm is clip=inf

    name = "norm"
    threshold_key = "max_norm"

    def __post_init__(self):
        self.positive("max_norm")
        if self.norm_type not in (1.0, 2.0):
            raise UserError(f"clip.norm_type={self.norm_type} is not supported; use 1 or 2 (or clip=inf)")

    def plan(self, params, grads, total_norm) -> ClipPlan:
        max_norm = self.max_norm
        return ClipPlan(total_norm > max_norm, lambda: clip_grads_with_norm_(params, max_norm, total_norm))

    def threshold(self) -> float:
        return float(self.max_norm)
