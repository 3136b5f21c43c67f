"""The sweeper's structured config, and its samplers and pruners, registered in Hydra's ConfigStore.

Hydra imports this module when it scans `hydra_plugins`, for every run, so it imports neither Optuna nor wapstable:
`hydra/sweeper=wapstable_optuna` composes without the `sweep` extra, and fails only when a sweep starts.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TPESamplerConfig:
    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None
    n_startup_trials: int = 10  # random draws before TPE models the good and the bad trials
    multivariate: bool = False


@dataclass
class RandomSamplerConfig:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None


@dataclass
class GridSamplerConfig:
    """Every combination of the `choice(...)` and `range(...)` params once, in an order drawn from `seed`; the
    sweeper fills in the search space and caps n_trials at the grid's size."""

    _target_: str = "optuna.samplers.GridSampler"
    seed: int | None = None


@dataclass
class MedianPrunerConfig:
    """Stop a trial whose valid ExpRate at an evaluation is below the median of the finished trials' at that step."""

    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 5  # finished trials before any pruning
    n_warmup_steps: int = 0  # training steps before a trial can be pruned
    interval_steps: int = 1


@dataclass
class PercentilePrunerConfig:
    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = 25.0  # prune below the 25th percentile (maximising): only the clearly bad trials
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    interval_steps: int = 1


@dataclass
class ThresholdPrunerConfig:
    """Stop a trial whose reported value is below `lower` (or above `upper`) after n_warmup_steps steps."""

    _target_: str = "optuna.pruners.ThresholdPruner"
    lower: float | None = None
    upper: float | None = None
    n_warmup_steps: int = 0
    interval_steps: int = 1


@dataclass
class NopPrunerConfig:
    """No pruning: every trial trains to the end."""

    _target_: str = "optuna.pruners.NopPruner"


@dataclass
class WapstableOptunaSweeperConf:
    _target_: str = "hydra_plugins.wapstable_optuna.optuna_sweeper.WapstableOptunaSweeper"
    _recursive_: bool = False  # the sweeper builds the sampler (a grid needs the search space) and the pruner
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "median"}])
    sampler: Any = MISSING
    pruner: Any = MISSING
    direction: str = "maximize"  # maximize | minimize the value train() returns
    study_name: str = "wapstable"
    # An Optuna storage URL; null = sqlite:///SWEEP_DIR/optuna.db, a study per sweep. A file of your own
    # (sqlite:///optuna.db) keeps the study, so a later sweep with the same study_name continues it.
    storage: str | None = None
    n_trials: int = 20
    n_jobs: int = 1  # trials per batch, run at once by a parallel launcher (joblib, submitit)
    # `key: choice(a, b)`, `key: range(1, 5)`, `key: interval(lo, hi)`, `key: tag(log, interval(lo, hi))`
    params: dict[str, str] = field(default_factory=dict)


cs = ConfigStore.instance()
cs.store(
    group="hydra/sweeper", name="wapstable_optuna", node=WapstableOptunaSweeperConf, provider="wapstable"
)
for name, node in [("tpe", TPESamplerConfig), ("random", RandomSamplerConfig), ("grid", GridSamplerConfig)]:
    cs.store(group="hydra/sweeper/sampler", name=name, node=node, provider="wapstable")
for name, node in [
    ("median", MedianPrunerConfig),
    ("percentile", PercentilePrunerConfig),
    ("threshold", ThresholdPrunerConfig),
    ("none", NopPrunerConfig),
]:
    cs.store(group="hydra/sweeper/pruner", name=name, node=node, provider="wapstable")
