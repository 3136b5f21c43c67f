"""A training command as a list of stages: `plan(cfg)` gives each stage's composed config (with pretrain.steps > 0,
first the pretraining on the rendered data in RUN_DIR/pretrain, then the run itself), and `train(cfg)` runs them in
turn, each starting from the one before it: from its best checkpoint (init_from) and, with pretrain.in_budget,
within what its time left of trainer.max_minutes."""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from wapstable.errors import UserError
from wapstable.train.build import pretrain_data, resolve_resume, validate_config
from wapstable.train.loop import Trainer
from wapstable.train.runlock import run_lock

log = logging.getLogger("wapstable")


@dataclass
class Stage:
    """One stage of a command: its name, its composed config (its run directory is `cfg.run_dir`), and whether
    the next stage starts from it (init_from its best.pt, the time budget less its own)."""

    name: str
    cfg: DictConfig
    hands_on: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    def done(self) -> bool:
        return (self.run_dir / "metrics.json").is_file()


def plan(cfg: DictConfig) -> list[Stage]:
    """The stages of `cfg`: the run alone, or the pretraining and then the run (pretrain.steps > 0, unless the run
    starts from weights of its own: init_from given, or a checkpoint of its own to resume)."""
    p, run_dir = cfg.pretrain, Path(cfg.run_dir)
    run = Stage("train", cfg)
    if p.steps <= 0 or cfg.init_from:
        return [run]
    sub_dir = run_dir / "pretrain"
    if resolve_resume(cfg, run_dir) or (run_dir / "checkpoints" / "last.pt").exists():
        # resumed: the pretraining's time counts again (a trainer.max_minutes given again on the command line is
        # reduced as the first start reduced it), its weights are in the run's own checkpoint already
        metrics = sub_dir / "metrics.json"
        return [Stage("train", within_budget(cfg, metrics) if metrics.is_file() else cfg)]
    validate_config(
        cfg
    )  # the run's own config first: a wrong value fails before the pretraining writes a file
    if p.steps < p.eval_every or p.eval_every <= 0:
        raise UserError(
            f"pretrain.eval_every={p.eval_every} must be in 1..pretrain.steps={p.steps}: the best checkpoint is chosen "
            "at its evaluations"
        )
    pretrain = OmegaConf.merge(
        cfg,
        {
            "run_dir": str(sub_dir),
            "resume": "auto",
            "init_from": None,
            "pretrain": {"steps": 0, "mix": 0},
            "trainer": {
                "max_steps": p.steps,
                "max_minutes": 0,
                "eval_every": p.eval_every,
                "checkpoint_every": p.eval_every,
            },
            "decode": {"final_beam_size": 1, "scales": [1.0]},  # its test a quick greedy check
        },
    )
    pretrain.data = pretrain_data(cfg)
    return [Stage("pretrain", pretrain, hands_on=True), run]


def train(
    cfg: DictConfig,
    overrides: list[str] | None = None,
    on_eval=None,
    parallel_jobs: int = 1,
) -> dict:
    """Train as `cfg` says, stage by stage; returns the last stage's metrics (also in its `metrics.json`).

    `overrides` are the command line's overrides: when resuming, they are applied on top of the checkpoint's
    config (they win); without them the given config is used as it is. `on_eval` gets each validation's record
    (step, exprate, wer, loss) of the run and may stop training there by returning True: a sweep's pruner, and the
    metrics then say `pruned`. `parallel_jobs`: how many runs share this machine's cores (`trainer.threads=auto`).
    """
    with run_lock(cfg.run_dir):  # one process per run directory (rank 0 under torchrun)
        stages = plan(cfg)
        for before, stage in zip([None, *stages], stages):
            if before is not None and before.hands_on:
                stage.cfg = started_from(stage.cfg, before)
            if stage.hands_on and stage.done():
                continue  # a finished pretraining is reused
            last = stage is stages[-1]
            if not last:
                log.info("%s: %d steps in %s", stage.name, stage.cfg.trainer.max_steps, stage.run_dir)
            metrics = run_stage(
                stage.cfg,
                overrides if last else None,
                on_eval if last else None,
                parallel_jobs,
            )
            if not last and metrics.get("preempted"):  # a stop signal: the caller exits as for the run itself
                raise UserError(
                    f"stopped during the {stage.name} stage; run the same command again to continue it from "
                    f"{stage.run_dir}"
                )
        return metrics


def run_stage(cfg: DictConfig, overrides, on_eval, parallel_jobs: int) -> dict:
    """One stage: its trainer, fitted; the loggers are closed however it ends."""
    trainer = Trainer(cfg, overrides, on_eval, parallel_jobs)
    finished = False
    try:
        metrics = trainer.fit()
        finished = not metrics.get("preempted")
        return metrics
    finally:
        trainer.close(finished)  # a run the guard stopped, or one that crashed, is marked failed


def started_from(cfg: DictConfig, before: Stage) -> DictConfig:
    """`cfg` starting from the stage `before`: init_from its best.pt, and the time its training took out of the
    budget (pretrain.in_budget)."""
    best = before.run_dir / "checkpoints" / "best.pt"
    if not best.is_file():
        raise UserError(
            f"the {before.name} stage in {before.run_dir} left no best.pt; delete it to train it again"
        )
    cfg = cfg.copy()
    cfg.init_from = str(best)
    return within_budget(cfg, before.run_dir / "metrics.json")


def within_budget(cfg: DictConfig, pretrain_metrics: Path) -> DictConfig:
    """`cfg` with trainer.max_minutes less the pretraining's own time (pretrain.in_budget; otherwise `cfg` as it is).

    The run's checkpoints keep the reduced budget, and a resumed run given trainer.max_minutes again reduces it again,
    so that a resumed run does not get the pretraining's minutes back.
    """
    budget = cfg.trainer.max_minutes
    if not cfg.pretrain.in_budget or budget <= 0:
        return cfg
    try:
        spent = float(json.loads(pretrain_metrics.read_text())["wall_time_s"]) / 60.0
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"pretrain.in_budget needs the pretraining's time, and {pretrain_metrics} does not give it ({e}); "
            f"delete {pretrain_metrics.parent} to pretrain again"
        ) from None
    left = budget - spent
    if left <= 0:
        raise UserError(
            f"the pretraining took {spent:.1f} of trainer.max_minutes={budget:g} (pretrain.in_budget=true), leaving "
            "no time to train; raise trainer.max_minutes or lower pretrain.steps"
        )
    log.info(
        "pretrain.in_budget: the pretraining took %.1f of trainer.max_minutes=%g; the run trains for %.1f",
        spent,
        budget,
        left,
    )
    cfg = cfg.copy()
    cfg.trainer.max_minutes = round(left, 3)
    return cfg
