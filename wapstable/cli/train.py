"""Training from the command line: `wapstable-train [overrides]` (or `python train.py [overrides]` in a checkout)
composes the config and calls `wapstable.train.stages.train`.

Exit status: 0 done; 1 config rejected by Hydra (or a crash); 2 a user error (config, data, checkpoint, full disk);
3 stopped by the guard; 143 stopped by SIGTERM, 144 by the preemption signal SIGUSR2 (submitit's requeue status),
both after writing checkpoints/last.pt (continue with resume=auto).
"""

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from wapstable.config import CONF_DIR, quote_group_options, register_configs
from wapstable.errors import TrainingStopped, TrialPruned, UserError

register_configs()
log = logging.getLogger("wapstable")


# The configs ship in the package; an absolute path, so the same files are found from a checkout and an install.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from wapstable.train.stages import train
    from wapstable.train.sweep import pruning_callback
    from wapstable.train.threads import parallel_jobs

    # In a sweep a failed job raises: the launcher records it as failed and runs the others (sys.exit would end the
    # whole sweep); Hydra exits non-zero once every job has run.
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    try:
        metrics = train(
            cfg,
            overrides=list(hc.overrides.task),
            on_eval=pruning_callback(cfg.optimize_metric),  # None outside an Optuna sweep's trial
            parallel_jobs=parallel_jobs(hc.launcher, hc.sweeper) if sweep else 1,
        )
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
    if metrics.get("preempted"):
        # Stopped by SIGTERM (143) or the preemption signal SIGUSR2 (144, "requeue me") after writing last.pt:
        # not finished, so not 0 (a `&&` chain or a scheduler's afterok must not take it for done). Also in a
        # sweep: the node is going away, so the remaining jobs must not start on it.
        sys.exit(metrics["exit_code"])
    if metrics.get("pruned"):  # the Optuna sweeper records the trial as pruned
        raise TrialPruned(f"pruned at step {metrics['steps']}")
    return metrics.get(cfg.optimize_metric)


def main() -> None:
    """The console entry point `wapstable-train`: Hydra reads the overrides from sys.argv."""
    sys.argv[1:] = quote_group_options(sys.argv[1:])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one run directory, rank-0 files
        from wapstable.train.distributed import torchrun_argv

        try:
            sys.argv = torchrun_argv(sys.argv)
        except UserError as e:  # before Hydra: its logging is not set up yet
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        # gloo's threads can abort the interpreter's teardown after a finished run ("terminate called without an
        # active exception", torch 2.14): flush, then leave with the run's own exit status.
        try:
            hydra_main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    hydra_main()


if __name__ == "__main__":
    main()
