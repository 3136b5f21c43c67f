"""The clip-rule protocol every clip mode follows, and the plan a rule makes before the guard's one host sync.

A clip mode is one class in one file (this package, or anywhere on the Python path) and one yaml under `conf/clip/`
naming it by `_target_`. The class is a dataclass whose fields are the mode's options: they are typed (OmegaConf
checks the values), and `__post_init__` refuses a value that cannot work, in one sentence naming the key, before
anything runs. See docs/extending.md.
"""

import dataclasses
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch

from wapstable.errors import UserError


class ClipPlan(NamedTuple):
    """A rule's decision, computed before the guard's one host sync, and the clipping to do if the step is taken.

    `flag` (a device bool: will clipping change a gradient) is read together with the finite flag, so knowing
    whether a step was clipped costs no second sync; `apply()` clips in place and touches no state before it runs,
    so a skipped step leaves the gradients as backward made them (for the anomaly checkpoint's per-layer figures)
    and a rule's state (AutoClip's history) unchanged.
    """

    flag: torch.Tensor
    apply: Callable[[], None]


def no_plan(device: torch.device | str = "cpu") -> ClipPlan:
    """A plan that changes nothing."""
    return ClipPlan(torch.zeros((), dtype=torch.bool, device=device), lambda: None)


@dataclasses.dataclass
class ClipRule:
    """The protocol of a clip mode; subclasses are dataclasses whose fields are the mode's options.

    - `name`: the mode's name in logs and reports (`clip=NAME` chooses its yaml);
    - `norm_type`: the norm of the total gradient norm the guard computes, logs and decides on (2, 1 or inf);
    - `plan(params, grads, total_norm) -> ClipPlan`: what clipping would do, without changing anything;
    - `threshold_key`: the option a rollback tightens (None: nothing to tighten), and `limit()` its value;
    - `backed_off(scale)`: a copy with that option multiplied by `scale`, sharing this rule's state;
    - `threshold()`: the global-norm threshold in force, for the statistics (None where the rule does not compare
      with the global norm);
    - `bind(model)`: called once with the model (AGC leaves its output layer alone);
    - `state_dict()` / `load_state_dict()`: what a checkpoint keeps of the rule (AutoClip's norm history).
    """

    name: ClassVar[str] = "rule"
    threshold_key: ClassVar[str | None] = None
    norm_type = 2.0  # a class attribute here; NormClip makes it an option

    def plan(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], total_norm: torch.Tensor
    ) -> ClipPlan:
        raise NotImplementedError

    def limit(self) -> float | None:
        return None if self.threshold_key is None else float(getattr(self, self.threshold_key))

    def backed_off(self, scale: float) -> "ClipRule":
        if self.threshold_key is None or scale == 1.0:
            return self
        fields = {f.name for f in dataclasses.fields(self)}
        new = dataclasses.replace(self, **{self.threshold_key: getattr(self, self.threshold_key) * scale})
        for key, value in vars(self).items():  # the state (history, bound parameters) is shared, not rebuilt
            if key not in fields:
                setattr(new, key, value)
        return new

    def threshold(self) -> float | None:
        return None

    def bind(self, model: torch.nn.Module) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def positive(self, *keys: str) -> None:
        """Refuse a non-positive value of any of `keys`, naming it (for `__post_init__`)."""
        for key in keys:
            value = getattr(self, key)
            if not value > 0:
                raise UserError(f"clip.{key}={value} must be positive for clip={self.name}")
