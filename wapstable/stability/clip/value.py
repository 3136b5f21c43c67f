"""`clip=value`: an elementwise clamp of every gradient to +-`clip.value`, exactly `torch.nn.utils.clip_grad_value_`."""

from dataclasses import dataclass

import torch
from torch.nn.utils import get_total_norm

from wapstable.stability.clip.base import ClipPlan, ClipRule


@dataclass
class ValueClip(ClipRule):
    value: float = 1.0

    name = "value"
    threshold_key = "value"

    def __post_init__(self):
        self.positive("value")

    def plan(self, params, grads, total_norm) -> ClipPlan:
        value = self.value
        largest = get_total_norm(grads, norm_type=float("inf"))
        return ClipPlan(largest > value, lambda: torch.nn.utils.clip_grad_value_(params, value))
