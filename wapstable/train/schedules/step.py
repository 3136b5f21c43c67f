"""optim.schedule=step: the lr times `gamma` every `step_size` steps."""

from dataclasses import dataclass
from typing import ClassVar

from wapstable.errors import UserError
from wapstable.train.schedules import BuiltinSchedule


@dataclass
class Step(BuiltinSchedule):
    name: ClassVar[str] = "step"
    step_size: int = 1000
    gamma: float = 0.5

    def __post_init__(self):
        if self.step_size <= 0:
            raise UserError(f"optim.step_size={self.step_size} must be a positive number of steps")
        if not 0 < self.gamma <= 1:
            raise UserError(f"optim.gamma={self.gamma} must be in (0, 1]: the factor the lr falls by")

    def factor(self, step: int, max_steps: int, time_done: float) -> float:
        return self.gamma ** (step // self.step_size)
