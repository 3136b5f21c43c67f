"""`clip=none`: no clipping (the non-finite guard still protects the weights)."""

from dataclasses import dataclass

from wapstable.stability.clip.base import ClipPlan, ClipRule, no_plan


@dataclass
class NoClip(ClipRule):
    name = "none"

    def plan(self, params, grads, total_norm) -> ClipPlan:
        return no_plan(total_norm.device)
