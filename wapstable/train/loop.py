"""The run: `train(cfg)` builds everything from the config, trains, evaluates, and returns the metrics.

`Trainer` is put together from one class per concern: `build` turns the config into components (below, in
`__init__`), `state.TrainingState` saves and loads the training state, `step.TrainingStep` takes one guarded step,
`events.RunEvents` does what happens around the steps (evaluation, checkpoints, loggers, signals, the summary). The
`fit` loop here reads in one sitting.
"""

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from wapstable.data.normalize import training_stats
from wapstable.device import resolve_device
from wapstable.errors import UserError
from wapstable.stability.clip import build_clip
from wapstable.stability.faults import Fault
from wapstable.stability.gradstats import GradStats
from wapstable.stability.guard import SpikeDetector
from wapstable.stability.rollback import Rollback
from wapstable.stability.step_guard import StepGuard
from wapstable.train import distributed
from wapstable.train.build import (
    build_checked_model,
    build_data,
    build_stream,
    init_from,
    load_resume,
    pretrain_data,
    resolve_resume,
    validate_config,
)
from wapstable.train.events import RunEvents, write_json
from wapstable.train.loggers import Loggers
from wapstable.train.optim import build_optimizer, build_scheduler
from wapstable.train.runlock import run_lock
from wapstable.train.signals import StopSignals, preemption_signal
from wapstable.train.state import Best, TrainingState
from wapstable.train.step import TrainingStep
from wapstable.train.threads import CoreShare, resolve_threads

log = logging.getLogger("wapstable")


class Trainer(TrainingStep, RunEvents, TrainingState):
    """A run built from `cfg`: `fit()` trains it and returns its metrics."""

    def __init__(
        self,
        cfg: DictConfig,
        overrides: list[str] | None = None,
        on_eval: Callable[[dict], bool] | None = None,
        parallel_jobs: int = 1,
    ):
        self.run_dir = Path(cfg.run_dir)
        cfg, self.resume_state, self.resume_path = load_resume(cfg, self.run_dir, overrides)
        self.fresh_over_existing = (
            self.resume_path is None and (self.run_dir / "checkpoints" / "last.pt").exists()
        )
        validate_config(cfg)
        threads = resolve_threads(cfg.trainer.threads, parallel_jobs)
        # auto: shared with the other trainers running on these cores, re-counted during fit
        self.cores = CoreShare(parallel_jobs) if cfg.trainer.threads == "auto" else contextlib.nullcontext()
        self.cfg, self.on_eval = cfg, on_eval
        self.dist = distributed.setup(cfg.trainer.ddp, cfg.trainer.device)
        self.device = self.dist.device if cfg.trainer.ddp else resolve_device(cfg.trainer.device)
        if threads > 0:
            torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)

        self.elapsed_before = (
            0.0  # training seconds of the runs this one resumes (the schedule may follow them)
        )
        self.start_time: float | None = None  # when fit began

        # Components, each from its part of the config.
        self.splits, self.vocab = build_data(cfg, self.resume_state)
        # the ink the model learns from, which every checkpoint records: evaluate.py and predict.py bring other
        # images to it (data/normalize.py)
        aug = cfg.data.get("pixel_aug")
        self.ink_stats = training_stats(
            [s.image for s in self.splits["train"]],
            scale=tuple(aug.scale) if aug is not None else (1.0, 1.0),
            pen=aug is not None and float(aug.pen) > 0,
        )
        self.model = build_checked_model(
            cfg, len(self.vocab), self.device, self.resume_state, self.resume_path
        )
        if cfg.init_from and self.resume_state is None:  # a resumed run has its own weights
            loaded = init_from(self.model, cfg.init_from, self.vocab)
            log.info(
                "init_from %s: %d tensors, %d tokens shared, %d new",
                cfg.init_from,
                loaded["tensors"],
                loaded["tokens_shared"],
                loaded["tokens_new"],
            )
            for head in loaded["heads_fresh"]:
                log.info(
                    "init_from: %s is not in the checkpoint; it starts from a fresh initialisation", head
                )
            for head in loaded["heads_dropped"]:
                log.info("init_from: the checkpoint's %s is not in this model; it is left out", head)
        self.ddp_model = self.dist.wrap(self.model)
        self.optimizer = build_optimizer(cfg.optim, self.model.parameters())
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, cfg.trainer.max_steps, self.time_done)
        self.base_lrs = list(self.scheduler.base_lrs)  # before any rollback's back-off
        self.stream = build_stream(cfg, self.splits, self.vocab, self.dist.rank, self.dist.world_size)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.trainer.precision == "fp16")
        self.fault = Fault(cfg.fault, self.dist.rank, preemption_signal())
        self.rollback = Rollback(cfg.guard)
        self.clip = build_clip(
            cfg.clip
        )  # the rule as configured; the guard clips by it, backed off after rollbacks
        self.clip.bind(self.model)  # AGC leaves the output layer alone
        self.spikes = SpikeDetector(cfg.guard.spike_window, cfg.guard.spike_zscore, cfg.guard.spike_warmup)
        self.stats = GradStats(  # grad_stats.csv and histograms; only the main rank writes statistics
            cfg.stats,
            self.run_dir if self.dist.is_main else None,
            norm_type=self.clip.norm_type,
        )
        g = cfg.guard
        self.guard = StepGuard(  # the same guard any PyTorch loop can use
            self.model,
            self.optimizer,
            scheduler=self.scheduler,
            clip=self.clip,
            scaler=self.scaler,
            skip_nonfinite=g.skip_nonfinite,
            spikes=self.spikes if g.skip_spikes else None,
            max_consecutive_skips=g.max_consecutive_skips,
            max_total_skips=g.max_total_skips,
            raise_on_exhausted=False,  # the trainer rolls back or stops, writing last.pt first
            max_anomaly_checkpoints=g.max_anomaly_checkpoints if g.checkpoint_on_anomaly else 0,
            write_anomaly=self.write_anomaly,
            stats=self.stats,
            reduce_flag=self.dist.any,
            agree=self.dist.agree,
        )
        self.budget = self.guard.budget

        # The run's own records.
        self.step = 0
        self.best = Best()  # the best valid ExpRate so far, and its step
        self.evals: list[dict] = []
        self.anomalies: list[dict] = []
        self.localization: dict | None = None
        self.stopped_by_time = self.pruned = (
            False  # pruned: a sweep's pruner stopped the run at an evaluation
        )
        self.stream_before: dict | None = None  # the stream's position before the current step's batch
        self.loggers: Loggers | None = None  # opened by fit, on the main rank only
        if self.resume_state is not None:
            self.load_state(self.resume_state)

    # ---- the public API of the tools that drive a trainer step by step (scripts/bench.py, scripts/gpu_check.py) ----
    def restart(self, state: dict, step: int = 0) -> None:
        """Put the training state back to `state` (weights, optimizer, schedule, GradScaler; the clip rule's state as
        a fresh rule has it) and number the next step `step`: every timed block of the benchmark starts so."""
        self.restore_training(state)
        self.clip.load_state_dict(build_clip(self.cfg.clip).state_dict())
        self.go_to_step(step)
        self.model.zero_grad(set_to_none=True)

    def go_to_step(self, step: int) -> None:
        """Number the next step `step` (what decides whether a fault fires, statistics are written, an evaluation
        runs), with nothing else changed."""
        self.step = int(step)

    def use_distributed(self, dist: distributed.Dist) -> None:
        """Train through `dist` from the next step: the model wrapped by it, and the guard's one decision and spike
        agreement taken over its ranks."""
        self.dist, self.ddp_model = dist, dist.wrap(self.model)
        self.guard.reduce_flag, self.guard.agree = dist.any, dist.agree

    def fit(self) -> dict:
        """Guarded steps, each followed by its events (consistency check, evaluation, snapshot, checkpoint), until
        trainer.max_steps, the time budget or a stop signal; then the final test (or, after a signal, last.pt and
        the hand-over to the cluster's requeue)."""
        t = self.cfg.trainer
        with self.cores:
            return self.fit_steps(t)

    def fit_steps(self, t: DictConfig) -> dict:
        self.begin()
        signals, progress = StopSignals(), self.progress_bar()
        share = getattr(self.cores, "update", lambda: None)
        try:
            with self.anomaly_detection(), signals:
                time_up = self.time_up()
                while self.step < t.max_steps and not time_up:
                    share()
                    lr = self.optimizer.param_groups[0]["lr"]  # the step's own: its scheduler steps after it
                    self.log_step(self.train_one(), progress, lr)
                    time_up = self.after_step(progress)
                    if self.pruned:  # a sweep's pruner gave up on this trial at its evaluation
                        return self.pruned_metrics()
                    if self.dist.agree(signals.received is not None):  # all ranks stop after the same step
                        return self.stop_for(signals)
        finally:
            if progress is not None:
                progress.close()
        return self.final_metrics()

    def begin(self) -> None:
        """Refuse to overwrite another run, create the run directory, open the logs, trust the starting state."""
        cfg = self.cfg
        if self.fresh_over_existing:  # checked after every other input, so those errors come first
            raise UserError(
                f"{self.run_dir} already holds a run (checkpoints/last.pt); continue it with resume=auto, or "
                "start a new one in another hydra.run.dir"
            )
        self.start_time = time.time()
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.vocab.save(self.run_dir / "vocab.txt")
            report = self.splits.report
            if any(report.values()):  # a data set read from files: what was used, what was skipped and why
                write_json(
                    self.run_dir / "data_report.json",
                    {**report, "samples": {k: len(v) for k, v in self.splits.items()}},
                )
        self.open_loggers()
        log.info(
            "model %s: %.2fM parameters; optimizer %s lr %g; clip %s; device %s; precision %s; %d threads",
            cfg.model.name,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            cfg.optim.name,
            cfg.optim.lr,
            self.clip.name,
            self.device,
            cfg.trainer.precision,
            torch.get_num_threads(),
        )
        self.dist.check_consistency(self.model, self.step)  # same step and weights on every rank (DDP only)
        self.rollback.start(self.state, on_disk=self.trusted_on_disk())

    def anomaly_detection(self):
        return torch.autograd.detect_anomaly() if self.cfg.guard.detect_anomaly else contextlib.nullcontext()


def train(
    cfg: DictConfig,
    overrides: list[str] | None = None,
    on_eval: Callable[[dict], bool] | None = None,
    parallel_jobs: int = 1,
) -> dict:
    """Train as `cfg` says; returns the metrics dict (also written to `metrics.json` in the run directory).

    `overrides` are the command line's overrides: when resuming, they are applied on top of the checkpoint's
    config (they win); without them the given config is used as it is. `on_eval` gets each validation's record
    (step, exprate, wer, loss) and may stop training there by returning True: a sweep's pruner, and the metrics
    then say `pruned`. `parallel_jobs`: how many runs share this machine's cores (for `trainer.threads=auto`).
    """
    with run_lock(cfg.run_dir):  # one process per run directory (rank 0 under torchrun)
        cfg = pretrain_first(cfg, parallel_jobs)
        trainer = Trainer(cfg, overrides, on_eval, parallel_jobs)
        finished = False
        try:
            metrics = trainer.fit()
            finished = not metrics.get("preempted")
            return metrics
        finally:
            trainer.close_loggers(finished)  # a run the guard stopped, or one that crashed, is marked failed
            trainer.dist.cleanup()


def pretrain_first(cfg: DictConfig, parallel_jobs: int = 1) -> DictConfig:
    """pretrain.steps > 0: train the same model on the rendered data first (the default synthetic data with
    pretrain.data's keys on top, the run's optimizer, `pretrain.steps` steps, in RUN_DIR/pretrain), and return `cfg` with init_from its best checkpoint.

    Skipped when the run starts from weights of its own (init_from given, or a checkpoint to resume); a finished
    pretraining (its metrics.json) is reused, an interrupted one resumes from its last.pt. With pretrain.in_budget,
    the returned trainer.max_minutes is what the pretraining's own time leaves of it (within_budget).
    """
    p = cfg.pretrain
    run_dir = Path(cfg.run_dir)
    sub_dir = run_dir / "pretrain"
    if p.steps <= 0 or cfg.init_from:
        return cfg
    if resolve_resume(cfg, run_dir) or (run_dir / "checkpoints" / "last.pt").exists():
        # resumed: a trainer.max_minutes given again on the command line is reduced as the first start reduced it
        metrics = sub_dir / "metrics.json"
        return within_budget(cfg, metrics) if metrics.is_file() else cfg
    # the run's own config first: a wrong value fails before the pretraining writes a file
    validate_config(cfg)
    if p.steps < p.eval_every or p.eval_every <= 0:
        raise UserError(
            f"pretrain.eval_every={p.eval_every} must be in 1..pretrain.steps={p.steps}: the best checkpoint is chosen "
            "at its evaluations"
        )
    best = sub_dir / "checkpoints" / "best.pt"
    if not (sub_dir / "metrics.json").is_file():
        data = pretrain_data(cfg)
        sub = OmegaConf.merge(
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
                "decode": {"final_beam_size": 1},
            },
        )
        sub.data = data
        log.info("pretraining on the rendered data: %d steps in %s", p.steps, sub_dir)
        metrics = train(sub, parallel_jobs=parallel_jobs)
        if metrics.get(
            "preempted"
        ):  # a stop signal during pretraining: the caller exits as for the run itself
            raise UserError(
                f"stopped during pretraining; run the same command again to continue it from {sub_dir}"
            )
    if not best.is_file():
        raise UserError(f"pretraining in {sub_dir} left no best.pt; delete {sub_dir} to pretrain again")
    cfg = cfg.copy()
    cfg.init_from = str(best)
    return within_budget(cfg, sub_dir / "metrics.json")


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
