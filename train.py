"""Entry point: `python train.py [overrides]` composes the config and calls `wapstable.trainer.train`."""

import logging
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

    from wapstable.trainer import train

    try:
        metrics = train(cfg, overrides=list(HydraConfig.get().overrides.task))
    except UserError as e:
        log.error("error: %s", e)
        sys.exit(2)
    except TrainingStopped as e:
        log.error("stopped: %s", e)
        sys.exit(3)
    return metrics.get(cfg.optimize_metric)


if __name__ == "__main__":
    main()
