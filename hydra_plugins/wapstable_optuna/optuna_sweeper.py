"""`hydra/sweeper=wapstable_optuna`: an Optuna search whose trials are Hydra jobs and can be pruned while they train.

Hydra imports this module in every run when it scans `hydra_plugins`; the work, and Optuna, live in `_impl.py`,
imported when a sweep is set up.
"""

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class WapstableOptunaSweeper(Sweeper):
    def __init__(self, **options: Any) -> None:
        self.options = options
        self.impl = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from ._impl import OptunaSearch

        self.impl = OptunaSearch(**self.options)
        self.impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        assert self.impl is not None, "setup() comes first"
        self.impl.sweep(arguments)
