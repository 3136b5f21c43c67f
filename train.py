"""Entry point: `python train.py [overrides]` composes the config and calls `wapstable.trainer.train`."""

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from wapstable.config import register_configs
from wapstable.errors import TrainingStopped, UserError

register_configs()
log = logging.getLogger("wapstable")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from wapstable.trainer import train

    # In a sweep a failed job raises: the launcher records it as failed and runs the others (sys.exit would end the
    # whole sweep); Hydra exits non-zero once every job has run.
    sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        metrics = train(cfg, overrides=list(HydraConfig.get().overrides.task))
    except UserError as e:
        log.error("error: %s", e)
        if sweep:
            raise
        sys.exit(2)
    except TrainingStopped as e:
        log.error("stopped: %s", e)
        if sweep:
            raise
        sys.exit(3)
    return metrics.get(cfg.optimize_metric)


if __name__ == "__main__":
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one run directory, rank-0 files
        from wapstable.distributed import torchrun_argv

        sys.argv = torchrun_argv(sys.argv)
    main()
