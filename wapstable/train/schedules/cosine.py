"""optim.schedule=cosine: from the base lr down to `min_lr_ratio` of it, along half a cosine that follows whichever
runs out first, the steps (trainer.max_steps) or the time (trainer.max_minutes), so a time-limited run still ends
its schedule at the minimum."""

import math
from dataclasses import dataclass
from typing import ClassVar

from wapstable.errors import UserError
from wapstable.train.schedules import BuiltinSchedule


@dataclass
class Cosine(BuiltinSchedule):
    name: ClassVar[str] = "cosine"
    min_lr_ratio: float = 0.0
    warmup_steps: int = 0  # the span starts after the warm-up (optim.warmup_steps)

    def __post_init__(self):
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]: the cosine's floor")

    def factor(self, step: int, max_steps: int, time_done: float) -> float:
        span = max(1, max_steps - self.warmup_steps)
        progress = min(1.0, max((step - self.warmup_steps) / span, time_done))
        floor = self.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
