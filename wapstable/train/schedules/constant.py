"""optim.schedule=constant: the base lr throughout."""

from dataclasses import dataclass
from typing import ClassVar

from wapstable.train.schedules import BuiltinSchedule


@dataclass
class Constant(BuiltinSchedule):
    name: ClassVar[str] = "constant"

    def factor(self, step: int, max_steps: int, time_done: float) -> float:
        return 1.0
