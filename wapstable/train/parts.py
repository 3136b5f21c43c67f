"""The components of a run, built from its config in one place (`build_parts`): data, model, optimizer and schedule,
the data stream, the clip rule, the guard and its helpers. `RunParts` holds them; the trainer's parts (checkpointer,
evaluator, run log) read them, and none of them calls back into the trainer."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from wapstable.data.batches import BatchStream
from wapstable.data.normalize import InkStats, training_stats
from wapstable.data.vocab import Vocab
from wapstable.device import resolve_device
from wapstable.stability.clip import ClipRule, build_clip
from wapstable.stability.faults import Fault
from wapstable.stability.gradstats import GradStats
from wapstable.stability.guard import SkipBudget, SpikeDetector
from wapstable.stability.rollback import Rollback
from wapstable.stability.step_guard import StepGuard
from wapstable.train import distributed
from wapstable.train.build import build_checked_model, build_data, build_stream, init_from
from wapstable.train.ema import WeightAverage
from wapstable.train.optim import build_optimizer, build_scheduler
from wapstable.train.signals import preemption_signal

log = logging.getLogger("wapstable")


@dataclass
class RunParts:
    """A run's components. `clip` is the rule as configured (the guard clips by it, backed off after rollbacks);
    `base_lrs` are the schedule's base lrs before any rollback's back-off."""

    cfg: DictConfig
    run_dir: Path
    device: torch.device
    dist: distributed.Dist
    splits: dict
    vocab: Vocab
    ink_stats: InkStats | None
    model: torch.nn.Module
    ddp_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    base_lrs: list[float]
    stream: BatchStream
    scaler: torch.amp.GradScaler
    fault: Fault
    rollback: Rollback
    clip: ClipRule
    spikes: SpikeDetector
    stats: GradStats
    guard: StepGuard
    ema: WeightAverage | None = None  # trainer.ema_decay: the averaged weights, the model that is read

    @property
    def eval_model(self) -> torch.nn.Module:
        """The model that validation, the test and the attention images read: the average where there is one."""
        return self.ema.module if self.ema is not None else self.model

    @property
    def budget(self) -> SkipBudget:
        return self.guard.budget

    def use_distributed(self, dist: distributed.Dist) -> None:
        """Train through `dist`: the model wrapped by it, the guard's decision and spike agreement over its ranks."""
        self.dist, self.ddp_model = dist, dist.wrap(self.model)
        self.guard.reduce_flag, self.guard.agree = dist.any, dist.agree


def build_parts(
    cfg: DictConfig,
    resume_state: dict | None,
    resume_path: Path | None,
    time_done: Callable[[], float],
    write_anomaly: Callable,
) -> RunParts:
    """Every component of the run from `cfg` (on top of a resumed run's vocabulary, weights and ink statistics).

    `time_done()` is the share of the time budget spent (the cosine schedule follows it); `write_anomaly` is the
    guard's writer of anomaly checkpoints."""
    run_dir = Path(cfg.run_dir)
    dist = distributed.setup(cfg.trainer.ddp, cfg.trainer.device)
    device = dist.device if cfg.trainer.ddp else resolve_device(cfg.trainer.device)
    torch.manual_seed(cfg.seed)
    splits, vocab = build_data(cfg, resume_state)
    # the ink the model learns from, which every checkpoint records: evaluate.py and predict.py bring other
    # images to it (data/normalize.py)
    aug = cfg.data.get("pixel_aug")
    ink_stats = training_stats(
        [s.image for s in splits["train"]],
        scale=tuple(aug.scale) if aug is not None else (1.0, 1.0),
        pen=aug is not None and float(aug.pen) > 0,
    )
    model = build_checked_model(cfg, len(vocab), device, resume_state, resume_path)
    if cfg.init_from and resume_state is None:  # a resumed run has its own weights
        report_init_from(init_from(model, cfg.init_from, vocab), cfg.init_from)
    optimizer = build_optimizer(cfg.optim, model.parameters())
    scheduler = build_scheduler(cfg.optim, optimizer, cfg.trainer.max_steps, time_done)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.trainer.precision == "fp16")
    clip = build_clip(cfg.clip)
    clip.bind(model)  # AGC leaves the output layer alone
    spikes = SpikeDetector(cfg.guard.spike_window, cfg.guard.spike_zscore, cfg.guard.spike_warmup)
    # grad_stats.csv and histograms; only the main rank writes statistics
    stats = GradStats(cfg.stats, run_dir if dist.is_main else None, norm_type=clip.norm_type)
    g = cfg.guard
    guard = StepGuard(  # the same guard any PyTorch loop can use
        model,
        optimizer,
        scheduler=scheduler,
        clip=clip,
        scaler=scaler,
        skip_nonfinite=g.skip_nonfinite,
        spikes=spikes if g.skip_spikes else None,
        max_consecutive_skips=g.max_consecutive_skips,
        max_total_skips=g.max_total_skips,
        raise_on_exhausted=False,  # the trainer rolls back or stops, writing last.pt first
        max_anomaly_checkpoints=g.max_anomaly_checkpoints if g.checkpoint_on_anomaly else 0,
        write_anomaly=write_anomaly,
        stats=stats,
        reduce_flag=dist.any,
        agree=dist.agree,
    )
    return RunParts(
        cfg=cfg,
        run_dir=run_dir,
        device=device,
        dist=dist,
        splits=splits,
        vocab=vocab,
        ink_stats=ink_stats,
        model=model,
        ddp_model=dist.wrap(model),
        optimizer=optimizer,
        scheduler=scheduler,
        base_lrs=list(scheduler.base_lrs),
        stream=build_stream(cfg, splits, vocab, dist.rank, dist.world_size),
        scaler=scaler,
        fault=Fault(cfg.fault, dist.rank, preemption_signal()),
        rollback=Rollback(cfg.guard),
        clip=clip,
        spikes=spikes,
        stats=stats,
        guard=guard,
        # from the weights the run starts with (a resumed run's average is loaded with the rest of its state)
        ema=WeightAverage(model, cfg.trainer.ema_decay) if cfg.trainer.ema_decay > 0 else None,
    )


def report_init_from(loaded: dict, path: str) -> None:
    log.info(
        "init_from %s: %d tensors, %d tokens shared, %d new",
        path,
        loaded["tensors"],
        loaded["tokens_shared"],
        loaded["tokens_new"],
    )
    for head in loaded["heads_fresh"]:
        log.info("init_from: %s is not in the checkpoint; it starts from a fresh initialisation", head)
    for head in loaded["heads_dropped"]:
        log.info("init_from: the checkpoint's %s is not in this model; it is left out", head)
