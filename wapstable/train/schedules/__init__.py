"""Learning-rate schedules after the warm-up, one module each: `optim.schedule` names a built-in one by its name
(`constant`, `cosine`, `step`: the modules here), or any class by a `_target_` node of its own
(`optim.schedule={_target_: mypkg.Poly, power: 2}`).

A schedule is a dataclass whose fields are its options (typed and checked before anything runs) with
- `name`: what logs and `optim.schedule` call it;
- `factor(step, max_steps, time_done) -> float`: the multiplier of the base lr at `step` after the warm-up, where
  `time_done` is the share of trainer.max_minutes spent (0 without a budget).
A built-in schedule takes its options from the `optim` keys of the same names (`optim.min_lr_ratio`, `optim.gamma`,
`optim.step_size`), as the command line has always given them.
"""

from dataclasses import fields
from typing import ClassVar, Protocol

from omegaconf import DictConfig, OmegaConf

from wapstable.errors import UserError
from wapstable.targets import classes_in, import_class, typed_options

SEE = "docs/configuration.md (optim.schedule)"


class Schedule(Protocol):
    name: ClassVar[str]

    def factor(self, step: int, max_steps: int, time_done: float) -> float: ...


class BuiltinSchedule:
    """The base of the schedules in this package (what finds them by name)."""

    name: ClassVar[str] = "schedule"


def builtin_schedules() -> dict[str, type]:
    """name -> class of every schedule in this package."""
    return {cls.name: cls for cls in classes_in(__name__, __path__, BuiltinSchedule)}


def build_schedule(cfg_optim: DictConfig) -> Schedule:
    """The schedule `optim.schedule` names, with its options; a wrong name or value is one sentence."""
    spec = cfg_optim.schedule
    if isinstance(spec, str):
        builtin = builtin_schedules()
        if spec not in builtin:
            raise UserError(
                f"optim.schedule={spec} is not a schedule; use one of {', '.join(sorted(builtin))}, or a node "
                "with a _target_ of your own"
            )
        cls = builtin[spec]
        given = {f.name: getattr(cfg_optim, f.name) for f in fields(cls) if hasattr(cfg_optim, f.name)}
    else:
        node = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec)
        if "_target_" not in node:
            raise UserError(
                "optim.schedule is a node without a _target_; name a schedule class or a built-in name"
            )
        cls = import_class(
            node.pop("_target_"), "optim.schedule", "name a schedule class (wapstable/train/schedules/)"
        )
    builtin_keys = isinstance(spec, str)
    schedule = typed_options(
        cls, given if builtin_keys else node, "optim" if builtin_keys else "optim.schedule", SEE
    )
    if not callable(getattr(schedule, "factor", None)):
        raise UserError(f"optim.schedule: {cls.__name__} has no factor(step, max_steps, time_done) method")
    return schedule
