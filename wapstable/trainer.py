"""The training loop: `train(cfg)` builds everything from the config, trains, evaluates, returns the metrics.

One step: forward (autocast), backward, grad norm, the guard's decision (one host sync), clip, optimizer and
scheduler step, or a skip that leaves weights, optimizer state, schedule and grad-norm history untouched.
"""

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from . import distributed
from .checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import Config, checkpoint_config
from .data import BatchStream, check_bucket_by, check_labels, filter_samples, load_splits, load_vocab
from .errors import TrainingStopped, UserError
from .evaluation import evaluate_samples
from .gradstats import GradStats, validate_stats_config
from .loggers import Loggers, build_loggers, check_logger_config
from .model import build_model
from .optim import build_optimizer, build_scheduler
from .runlock import run_lock
from .signals import StopSignals
from .stability.clipping import (
    AutoClipHistory,
    clip_options,
    clip_threshold,
    mode_norm_type,
    scaled_threshold,
    validate_clip_config,
)
from .stability.faults import Fault
from .stability.guard import SpikeDetector, grad_figures
from .stability.rollback import Rollback
from .stability.step_guard import Outcome, StepGuard, StepResult
from .threads import resolve_threads
from .train.step import autocast, counting_loss, forward_loss, resolve_device, sequence_loss  # noqa: F401
from .vocab import Vocab

log = logging.getLogger("wapstable")


def effective_config(cfg: DictConfig, saved: dict, overrides: list[str]) -> DictConfig:
    """The checkpoint's config with this command line's overrides on top (they win), as a resumed run uses."""
    keys = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("hydra") or key in ("resume", "run_dir"):
            continue
        if "." not in key and key not in Config.__dataclass_fields__:
            # A preset of the _global_ package (debug=tiny, experiment=...): no key of its own; what it set is in
            # the checkpoint's config already, when the run was started with it.
            continue
        keys.append(key)
    merged = checkpoint_config(saved, keys, cfg)
    merged.resume, merged.run_dir = cfg.resume, cfg.run_dir
    return merged


def validate_config(cfg: DictConfig) -> None:
    """Fail fast, before any file is written, on values the schema's types cannot catch."""
    t = cfg.trainer
    for key in ("max_steps", "eval_every", "checkpoint_every", "log_every"):
        if t[key] <= 0:
            raise UserError(f"trainer.{key}={t[key]} must be a positive number of steps")
    if t.max_minutes < 0:
        raise UserError(f"trainer.max_minutes={t.max_minutes} must be >= 0 (0 = no time limit)")
    if t.precision not in ("32", "bf16", "fp16"):
        raise UserError(f"trainer.precision={t.precision!r} is unknown; use 32, bf16 or fp16")
    validate_clip_config(cfg.clip)
    validate_stats_config(cfg.stats)
    check_logger_config(cfg.logger)
    g = cfg.guard
    if g.max_consecutive_skips < 0 or g.max_total_skips < 0:
        raise UserError("guard.max_consecutive_skips and guard.max_total_skips must be >= 0")
    if g.on_budget_exhausted not in ("stop", "rollback"):
        raise UserError(
            f"guard.on_budget_exhausted={g.on_budget_exhausted!r} is unknown; use stop or rollback"
        )
    if g.snapshot_every < 0 or g.max_rollbacks < 0:
        raise UserError(
            "guard.snapshot_every and guard.max_rollbacks must be >= 0 (snapshot_every=0: snapshots only at "
            "checkpoints)"
        )
    if not (0 < g.lr_backoff <= 1 and 0 < g.clip_backoff <= 1):
        raise UserError("guard.lr_backoff and guard.clip_backoff must be in (0, 1]: a rollback lowers them")
    d = cfg.data
    if d.curriculum_epochs < 0:
        raise UserError(f"data.curriculum_epochs={d.curriculum_epochs} must be >= 0 (0 = no curriculum)")
    check_bucket_by(d.bucket_by)  # before the data is rendered or read
    if d.pixel_budget <= 0 or d.max_batch <= 0:
        raise UserError("data.pixel_budget and data.max_batch must be positive")
    if cfg.decode.max_len <= 0 or cfg.decode.beam_size <= 0 or cfg.decode.final_beam_size <= 0:
        raise UserError("decode.max_len, decode.beam_size and decode.final_beam_size must be positive")


def resolve_resume(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: resume=PATH, or for resume=auto the run's last.pt when there is one."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        last = run_dir / "checkpoints" / "last.pt"
        if last.is_file():
            return last
        log.info("resume=auto: no %s yet, starting fresh", last)  # a restarted job's log says which it did
        return None
    return Path(cfg.resume).expanduser()


def check_model_compatible(model: torch.nn.Module, state: dict, path: Path) -> None:
    """Refuse a checkpoint whose parameters do not fit this model, naming the first mismatch."""
    own = model.state_dict()
    missing = sorted(set(own) ^ set(state))
    if missing:
        raise UserError(
            f"checkpoint {path} holds another model (parameter {missing[0]} is in one but not the other); "
            "resume with the model config it was trained with"
        )
    for k, v in own.items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise UserError(
                f"checkpoint {path} holds a model of another size ({k}: {tuple(state[k].shape)} there, "
                f"{tuple(v.shape)} here); resume with the model config it was trained with"
            )


class Trainer:
    def __init__(
        self,
        cfg: DictConfig,
        overrides: list[str] | None = None,
        on_eval: Callable[[dict], bool] | None = None,
        parallel_jobs: int = 1,
    ):
        self.run_dir = Path(cfg.run_dir)
        resume_path = resolve_resume(cfg, self.run_dir)
        self.resume_state = None
        if resume_path is not None:
            self.resume_state = load_checkpoint(resume_path)
            if "config" not in self.resume_state or "model" not in self.resume_state:
                raise UserError(
                    f"{resume_path} is a checkpoint without a training state; it cannot be resumed"
                )
            if overrides is not None:
                cfg = effective_config(cfg, self.resume_state["config"], overrides)
            log.info("resuming from %s (step %d)", resume_path, self.resume_state["step"])
        self.resume_path = resume_path
        self.fresh_over_existing = resume_path is None and (self.run_dir / "checkpoints" / "last.pt").exists()
        validate_config(cfg)
        threads = resolve_threads(cfg.trainer.threads, parallel_jobs)
        self.cfg = cfg
        self.on_eval = on_eval
        self.dist = distributed.setup(cfg.trainer.ddp, cfg.trainer.device)
        self.device = self.dist.device if cfg.trainer.ddp else resolve_device(cfg.trainer.device)
        if threads > 0:
            torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)

        self.splits = load_splits(cfg.data)
        if self.resume_state is not None:
            self.vocab = Vocab(list(self.resume_state["vocab"]))
        else:
            self.vocab = load_vocab(cfg.data, self.splits)
        d = cfg.data
        for split in self.splits:
            samples = check_labels(self.splits[split], self.vocab, d.on_error)
            if split == "train":
                samples = filter_samples(samples, d.max_image_pixels, d.max_tokens)
            if not samples:
                raise UserError(
                    f"no {split} sample is left after filtering; raise data.max_image_pixels or data.max_tokens"
                )
            self.splits[split] = samples
        log.info(
            "data: %s, %d train / %d valid / %d test samples, vocabulary of %d tokens",
            d.name,
            *(len(self.splits[s]) for s in ("train", "valid", "test")),
            len(self.vocab),
        )

        try:
            self.model = build_model(cfg.model, len(self.vocab)).to(self.device)
        except ValueError as e:  # a model size that cannot be built: the message names the key
            raise UserError(str(e)) from None
        if self.resume_state is not None:
            check_model_compatible(self.model, self.resume_state["model"], resume_path)
            saved_optim = self.resume_state["config"].get("optim", {}).get("name")
            if saved_optim and saved_optim != cfg.optim.name:
                raise UserError(
                    f"checkpoint {resume_path} holds the state of optimizer {saved_optim}, not "
                    f"optim.name={cfg.optim.name}; resume with optim={saved_optim} (its lr and schedule may change)"
                )
        self.ddp_model = self.dist.wrap(self.model)
        self.optimizer = build_optimizer(cfg.optim, self.model.parameters())
        self.elapsed_before = 0.0  # training seconds of the runs this one resumes
        self.start_time: float | None = None  # when fit began
        self.stream_before: dict | None = None  # the stream's position before the current step's batch
        self.pruned = False  # set when on_eval (a sweep's pruner) stops the run
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, cfg.trainer.max_steps, self.time_done)
        self.stream = BatchStream(
            self.splits["train"],
            self.vocab,
            d.pixel_budget,
            d.max_batch,
            cfg.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            num_workers=d.num_workers,
            bucket_by=d.bucket_by,
            curriculum_epochs=d.curriculum_epochs,
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.trainer.precision == "fp16")
        self.history = AutoClipHistory(cfg.clip.history)
        output_params = set(self.model.output_layer_names())
        self.clip_skip = [p for n, p in self.model.named_parameters() if n in output_params]
        self.norm_type = mode_norm_type(cfg.clip.mode, cfg.clip.norm_type)
        self.spikes = SpikeDetector(cfg.guard.spike_window, cfg.guard.spike_zscore, cfg.guard.spike_warmup)
        self.fault = Fault(cfg.fault, self.dist.rank)
        self.rollback = Rollback(cfg.guard)
        self.stats = GradStats(  # grad_stats.csv, histograms, attention images
            cfg.stats,
            self.run_dir if self.dist.is_main else None,  # only the main rank writes statistics
            threshold=lambda: clip_threshold(self.cfg.clip, self.history, self.rollback.clip_scale),
            norm_type=self.norm_type,
        )
        g = cfg.guard
        self.guard = StepGuard(  # the same guard any PyTorch loop can use
            self.model,
            self.optimizer,
            scheduler=self.scheduler,
            clip=cfg.clip.mode,
            **clip_options(cfg.clip, self.history, skip=self.clip_skip),
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
        self.base_lrs = list(self.scheduler.base_lrs)  # before any back-off
        self.step = 0
        self.best = {"exprate": -1.0, "step": -1}
        self.evals: list[dict] = []
        self.anomalies: list[dict] = []
        self.localization: dict | None = None
        self.stopped_by_time = False
        if self.resume_state is not None:
            self.load_state(self.resume_state)
        self.loggers: Loggers | None = None  # opened by fit, on the main rank only

    # ---- state ----
    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "stream": self.stream.state_dict(),
            "rng": rng_state(),
            "vocab": list(self.vocab.tokens),
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "guard": {
                "budget": self.budget.state_dict(),
                "spikes": self.spikes.state_dict(),
                "history": self.history.state_dict(),
            },
            "rollback": self.rollback.state_dict(),
            "best": dict(self.best),
            "counters": self.counters(),
            "evals": list(self.evals),
            "anomalies": list(self.anomalies),
            "elapsed": self.elapsed(),
        }

    def restore_training(self, state: dict) -> None:
        """Model, optimizer, schedule, GradScaler and grad-norm history from a state: what resume, a rollback and
        the benchmark's reset have in common."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.history.load_state_dict(state["guard"]["history"])
        self.guard.refresh()  # the buffers as loaded are the ones before the next forward

    def load_state(self, state: dict) -> None:
        self.restore_training(state)
        self.step = int(state["step"])
        self.stream.load_state_dict(state["stream"])
        self.budget.load_state_dict(state["guard"]["budget"])
        self.spikes.load_state_dict(state["guard"]["spikes"])
        if "rollback" in state:
            self.rollback.load_state_dict(state["rollback"])
        self.apply_backoff()
        self.best = dict(state["best"])
        c = state["counters"]
        self.guard.accepted, self.guard.clipped = int(c["accepted"]), int(c["clipped"])
        self.guard.scaler_skips, self.guard.anomaly_checkpoints = (
            int(c["scaler_skips"]),
            int(c["anomaly_checkpoints"]),
        )
        self.evals = list(state["evals"])
        self.anomalies = list(state["anomalies"])
        self.elapsed_before = float(state.get("elapsed", 0.0))
        set_rng_state(state["rng"])
        self.guard.refresh()  # and the RNG

    def trusted_on_disk(self) -> dict | None:
        """The resumed run's checkpoints/trusted.pt (rollback only): a trusted state older than the resumed one."""
        if not self.rollback.enabled or self.resume_path is None:
            return None
        path = self.resume_path.parent / "trusted.pt"
        if not path.is_file():
            return None
        try:
            return load_checkpoint(path)
        except UserError as e:
            log.warning("rollback: ignoring %s (%s)", path, e)
            return None

    def time_done(self) -> float:
        """The share of trainer.max_minutes spent so far (resumed runs included); 0 without a budget."""
        budget = 60.0 * self.cfg.trainer.max_minutes
        return min(1.0, self.elapsed() / budget) if budget > 0 else 0.0

    def time_up(self) -> bool:
        """Whether the wall-clock budget is spent, the same answer on every rank."""
        return self.cfg.trainer.max_minutes > 0 and self.dist.agree(self.time_done() >= 1.0)

    def elapsed(self) -> float:
        return self.elapsed_before + (time.time() - self.start_time if self.start_time is not None else 0.0)

    def save(self, name: str) -> Path | None:
        if not self.dist.is_main:
            return None
        if name == "last" and (trusted := self.rollback.to_write()) is not None:
            save_checkpoint(trusted, self.run_dir / "checkpoints" / "trusted.pt")  # apart from last.pt
        return save_checkpoint(self.state(), self.run_dir / "checkpoints" / f"{name}.pt")

    # ---- one step ----
    def counters(self) -> dict:
        g = self.guard
        return {
            "clipped": g.clipped,
            "accepted": g.accepted,
            "scaler_skips": g.scaler_skips,
            "anomaly_checkpoints": g.anomaly_checkpoints,
        }

    def train_step(self, batch, rng_before: dict | None = None) -> StepResult:
        """The model's forward (with the configured fault), then the guarded step: backward, the finite
        decision, clipping, and the optimizer and scheduler step or a bit-exact skip."""
        step = self.step
        self.fault.set_model(self.model, step)
        self.model.train()
        loss = forward_loss(self.ddp_model, batch, self.fault, step, self.cfg.trainer.precision)
        lr_mult = self.fault.lr_multiplier(step)

        def spike_lr():  # lr_spike: this step's lr times fault.scale; the scheduler's step resets it
            for group in self.optimizer.param_groups:
                group["lr"] *= lr_mult

        self.guard.steps = step
        return self.guard.step(
            loss, batch=batch, rng_before=rng_before, before_update=spike_lr if lr_mult != 1.0 else None
        )

    def handle_skip(self, result: StepResult) -> None:
        """A skipped step: warn, localise the first anomaly, and when the budget is spent roll back or stop."""
        cfg = self.cfg
        if result.outcome is Outcome.SCALER:
            log.info(
                "step %d: fp16 overflow, GradScaler lowers its scale to %g",
                self.step,
                self.scaler.get_scale(),
            )
            return
        log.warning("step %d skipped: %s", self.step, result.reason)
        path = result.anomaly_path
        if (
            path is not None
            and self.localization is None
            and cfg.guard.localize
            and cfg.guard.checkpoint_on_anomaly
        ):
            self.localize(path)
        if result.budget_exhausted:
            reason = result.budget_exhausted
            if self.rollback.can_roll_back() and self.roll_back(reason):
                return
            if self.rollback.events:
                reason += f" after {len(self.rollback.events)} rollbacks (guard.max_rollbacks={cfg.guard.max_rollbacks})"
            self.save("last")
            self.finish_logs()
            raise TrainingStopped(
                f"{reason} at step {self.step}; anomaly checkpoints are in {self.run_dir / 'anomalies'}, "
                f"replay one with `python scripts/replay_anomaly.py PATH`"
            )

    def apply_backoff(self) -> None:
        """Scale the schedule's base lrs by the rollback back-off in force, and set the current lrs to match."""
        self.scheduler.base_lrs = [lr * self.rollback.lr_scale for lr in self.base_lrs]
        # This step's lr from the new base lrs; the scheduler's next step() computes the same (the trainer reads the
        # lr from the optimizer, never the scheduler's private copy).
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * factor
        opts = clip_options(self.cfg.clip, self.history, skip=self.clip_skip, scale=self.rollback.clip_scale)
        self.guard.set_clip(**opts)

    def roll_back(self, reason: str) -> bool:
        """Restore the newest trusted state, back off lr and clip threshold, keep the data stream going."""
        state = self.rollback.pick()
        if state is None:
            log.error("rollback: no state from before the failures to return to")
            return False
        source = self.rollback.floor_source if state is self.rollback.floor else "snapshot"
        self.restore_training(state)
        self.rollback.back_off()
        self.apply_backoff()
        self.budget.consecutive = 0
        event = {
            "step": self.step,
            "restored_step": int(state["step"]),
            "source": source,
            "reason": reason,
            "lr": self.optimizer.param_groups[0]["lr"],
            "clip_threshold": scaled_threshold(self.cfg.clip, self.rollback.clip_scale),
            "batches_skipped": self.step + 1 - int(state["step"]),
        }
        self.rollback.record(event)
        log.warning(
            "ROLLBACK %d/%d at step %d: %s; restored the %s of step %d, lr now %.4g, clip threshold %s, "
            "%d batches skipped",
            len(self.rollback.events),
            self.cfg.guard.max_rollbacks,
            self.step,
            reason,
            source,
            event["restored_step"],
            event["lr"],
            event["clip_threshold"],
            event["batches_skipped"],
        )
        # At the count of steps done, as train/*: this rollback ends step self.step + 1.
        self.scalar("guard/rollback", len(self.rollback.events), self.step + 1)
        if self.loggers is not None:
            self.loggers.text("guard/rollbacks", json.dumps(event), self.step + 1)
        return True

    def write_anomaly(self, result: StepResult, batch, rng_before: dict) -> Path | None:
        """anomalies/step-N.pt: the state before the step, its RNG, the offending batch and per-layer figures."""
        per_layer_norm, per_layer_bad = grad_figures(self.model)
        record = {
            "step": self.step,
            "reason": result.reason,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
        }
        if self.dist.enabled:  # collectives: every rank gets here, since all ranks skip together
            # This rank's own view: DDP averaged the gradients, so after backward a NaN is on every rank.
            seen = not math.isfinite(result.loss) or self.dist.local_grads_nonfinite
            record["ranks"] = self.dist.ranks_with(seen)
            src = record["ranks"][0] if record["ranks"] else 0
            if src != 0:  # rank 0 writes the checkpoint: it takes the batch and loss of the rank that saw it
                mine = (type(batch)(*(t.cpu() for t in batch[:4]), batch.ids), result.loss, result.reason)
                theirs = self.dist.from_rank(src, mine if self.dist.rank == src else None)
                batch, record["loss"], record["reason"] = theirs
            record["batch_rank"] = src  # replay applies that rank's share of the fault
        # On every rank, as the guard's count of anomaly checkpoints: the next skip's collectives depend on it.
        self.anomalies.append(record)
        if not self.dist.is_main:
            return None
        state = self.state()
        # Before the step: the stream had not yet handed out this batch, and the RNG was as saved before forward.
        state["stream"] = self.stream_before if self.stream_before is not None else self.stream.state_dict()
        state["rng"] = rng_before
        state["anomaly"] = {
            **record,
            "batch": {
                "images": batch.images.cpu(),
                "image_mask": batch.image_mask.cpu(),
                "targets": batch.targets.cpu(),
                "target_mask": batch.target_mask.cpu(),
                "ids": list(batch.ids),
            },
            "grad_norms": per_layer_norm,
            "nonfinite_counts": per_layer_bad,
        }
        path = save_checkpoint(state, self.run_dir / "anomalies" / f"step-{self.step}.pt")
        log.warning("step %d: anomaly checkpoint written to %s", self.step, path)
        return path

    def localize(self, path: Path) -> None:
        from .stability.replay import replay, summarize

        try:
            report = replay(load_checkpoint(path), self.device)
        except Exception as e:  # a failed diagnosis must not end the run it diagnoses
            log.warning("localisation of %s failed: %s", path, e)
            return
        self.localization = {"checkpoint": str(path), **report}
        log.warning("localisation: %s", summarize(report))

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, split: str, beam_size: int | None = None) -> dict:
        """Metrics (and teacher-forced loss) of a split, through the same code as scripts/evaluate.py."""
        cfg = self.cfg
        self.fault.set_model(self.model, -1)  # faults act on training steps only

        def loss_fn(model, batch):
            with autocast(self.device, cfg.trainer.precision):
                logits = model(batch.images, batch.image_mask, batch.targets, batch.target_mask)
            return sequence_loss(logits, batch.targets, batch.target_mask)

        return evaluate_samples(
            self.model,
            self.vocab,
            self.splits[split],
            beam_size or cfg.decode.beam_size,
            cfg.decode.max_len,
            cfg.data.pixel_budget,
            cfg.data.max_batch,
            self.device,
            loss_fn=loss_fn,
        )

    # ---- logging ----
    def open_loggers(self) -> None:
        """The loggers of `cfg.logger` (the main rank only); the gradient statistics log through them too."""
        if self.dist.is_main and self.loggers is None:
            config = OmegaConf.to_container(self.cfg, resolve=True)
            self.loggers = build_loggers(self.cfg.logger, self.run_dir, config)
            self.stats.loggers = self.loggers

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.loggers is not None:
            self.loggers.scalar(tag, value, step)

    def finish_logs(self) -> None:
        if self.loggers is not None:
            self.loggers.flush()

    def close_loggers(self, finished: bool) -> None:
        if self.loggers is not None:
            self.loggers.close(finished)
            self.loggers = self.stats.loggers = None

    # ---- the loop ----
    def fit(self) -> dict:
        """Guarded steps, each followed by its events (consistency check, evaluation, snapshot, checkpoint), until
        trainer.max_steps, the time budget or a stop signal; then the final test (or, after a signal, last.pt and
        the hand-over to the cluster's requeue)."""
        t = self.cfg.trainer
        self.begin()
        signals, progress = StopSignals(), self.progress_bar()
        try:
            with self.anomaly_detection(), signals:
                time_up = self.time_up()
                while self.step < t.max_steps and not time_up:
                    self.log_step(self.train_one(), progress)
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
        self.open_loggers()
        log.info(
            "model %s: %.2fM parameters; optimizer %s lr %g; clip %s; device %s; precision %s; %d threads",
            cfg.model.name,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            cfg.optim.name,
            cfg.optim.lr,
            cfg.clip.mode,
            self.device,
            cfg.trainer.precision,
            torch.get_num_threads(),
        )
        self.dist.check_consistency(self.model, self.step)  # same step and weights on every rank (DDP only)
        self.rollback.start(self.state, on_disk=self.trusted_on_disk())

    def progress_bar(self):
        t = self.cfg.trainer
        if not (t.progress and self.dist.is_main):
            return None
        from tqdm import tqdm

        # Under a time budget the step total is only a cap: say so, since the bar's ETA counts steps.
        desc = (
            f"train (ends at {t.max_minutes:g} min or step {t.max_steps})" if t.max_minutes > 0 else "train"
        )
        return tqdm(total=t.max_steps, initial=self.step, desc=desc, dynamic_ncols=True)

    def anomaly_detection(self):
        return torch.autograd.detect_anomaly() if self.cfg.guard.detect_anomaly else contextlib.nullcontext()

    def train_one(self) -> StepResult:
        """Draw a batch and take one guarded step; a skip is warned about, and may roll back or stop the run."""
        self.stream_before = self.stream.state_dict()  # where an anomaly checkpoint's replay starts
        batch = self.stream.next().to(self.device)
        rng_before = rng_state() if self.cfg.guard.checkpoint_on_anomaly else None
        out = self.train_step(batch, rng_before)
        self.fault.preempt(self.step)
        self.rollback.note_step(self.step, out.counted)
        if out.skipped:
            self.handle_skip(out)
        self.step += 1
        return out

    def after_step(self, progress) -> bool:
        """The events after a step; returns whether the time budget is spent."""
        t = self.cfg.trainer
        if self.dist.should_check(self.step, t.consistency_every):
            self.dist.check_consistency(self.model, self.step)
        time_up = self.time_up()
        last = self.step == t.max_steps or time_up
        if time_up:
            self.stopped_by_time = True
            message = f"trainer.max_minutes={t.max_minutes:g} spent: training ends at step {self.step}"
            if progress is not None:
                progress.write(message)
            log.info(message)
        checkpoint_now = self.step % t.checkpoint_every == 0 or last
        self.rollback.maybe_snapshot(self.step, self.state, checkpoint_now)  # on every rank
        if self.step % t.eval_every == 0 or last:
            record = self.run_eval(progress)
            self.pruned = self.ask_pruner(record) and not last  # a finished run is a result
        if checkpoint_now:
            self.save("last")
        return time_up

    def stop_for(self, signals: StopSignals) -> dict:
        """SIGTERM or the preemption signal: last.pt now, then submitit's requeue (or the caller's exit code)."""
        self.save("last")
        log.warning("%s: checkpoint written at step %d; resume with resume=auto", signals.name, self.step)
        self.finish_logs()
        signals.hand_over()  # under submitit: requeue the job and exit
        return {"stopped_at": self.step, "preempted": True, "exit_code": signals.exit_code}

    def log_step(self, out: StepResult, progress) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        if self.dist.is_main:
            self.scalar("train/loss", out.loss, self.step)
            self.scalar("train/grad_norm", out.grad_norm, self.step)
            self.scalar("train/lr", lr, self.step)
            self.scalar("train/clipped", float(out.clipped), self.step)
            self.scalar("train/skipped", float(out.skipped), self.step)
        if progress is not None:
            progress.update(1)
            if self.step % self.cfg.trainer.log_every == 0 or out.skipped:
                progress.set_postfix(
                    loss=f"{out.loss:.3f}", gnorm=f"{out.grad_norm:.3g}", skipped=self.budget.total
                )
        if self.step % self.cfg.trainer.log_every == 0:
            log.debug("step %d loss %.4f grad_norm %.4g lr %.3g", self.step, out.loss, out.grad_norm, lr)

    def run_eval(self, progress) -> dict:
        result = self.evaluate("valid")
        record = {
            "step": self.step,
            "exprate": result["exprate"],
            "wer": result["wer"],
            "loss": result["loss"],
        }
        self.evals.append(record)
        message = (
            f"step {self.step}: valid ExpRate {result['exprate']:.2f}%  WER {result['wer']:.2f}%  "
            f"loss {result['loss']:.3f}"
        )
        if progress is not None:
            progress.write(message)
        log.info(message)
        for k in ("exprate", "wer", "loss"):
            self.scalar(f"valid/{k}", result[k], self.step)
        valid = self.splits["valid"]  # a few samples drawn with their attention, to TensorBoard
        self.stats.log_attention(self.model, valid, self.vocab, self.step, self.cfg.decode.max_len)
        if result["exprate"] > self.best["exprate"]:
            self.best = {"exprate": result["exprate"], "step": self.step}
            self.save("best")
        return record

    def ask_pruner(self, record: dict) -> bool:
        """Hand an evaluation to `on_eval` (a sweep's pruner, on the main rank); True on every rank if it says stop."""
        if self.on_eval is None:
            return False
        return self.dist.agree(self.dist.is_main and bool(self.on_eval(record)))

    def training_metrics(self) -> dict:
        """The figures of the training so far (validation, skips, anomalies), without a test evaluation."""
        final_valid = self.evals[-1] if self.evals else {}
        counters = self.counters()
        accepted = max(1, counters["accepted"])
        return {
            "steps": self.step,
            "stopped_by_time": self.stopped_by_time,
            "wall_time_s": round(self.elapsed(), 2),
            "best_valid_exprate": self.best["exprate"],
            "best_step": self.best["step"],
            "final_valid_exprate": final_valid.get("exprate"),
            "final_valid_wer": final_valid.get("wer"),
            "skipped_steps": self.budget.total + counters["scaler_skips"],
            "skipped_nonfinite": self.budget.nonfinite,
            "skipped_spikes": self.budget.spikes,
            "scaler_skips": counters["scaler_skips"],
            "anomaly_checkpoints": counters["anomaly_checkpoints"],
            "anomalies": self.anomalies,
            "clip_fraction": counters["clipped"] / accepted,
            "localization": self.localization,
            "rollbacks": self.rollback.events,
            "evals": self.evals,
        }

    def pruned_metrics(self) -> dict:
        """A pruned trial's figures (no test evaluation: the sweep has given up on it), in metrics.json too."""
        metrics = {**self.training_metrics(), "pruned": True}
        log.info(
            "pruned by the sweep at step %d: valid ExpRate %.2f%% (best %.2f%%)",
            self.step,
            self.evals[-1]["exprate"],
            self.best["exprate"],
        )
        self.finish_logs()
        if self.dist.is_main:
            write_json(self.run_dir / "metrics.json", metrics)
        return metrics

    def final_metrics(self) -> dict:
        cfg = self.cfg
        best_path = self.run_dir / "checkpoints" / "best.pt"
        if best_path.is_file():
            self.model.load_state_dict(load_checkpoint(best_path)["model"])
        test = self.evaluate("test", beam_size=cfg.decode.final_beam_size)
        metrics = {
            **self.training_metrics(),
            "test_exprate": test["exprate"],
            "test_wer": test["wer"],
            "test_within_1": test["within_1"],
        }
        log.info(
            "done: %d steps in %.0f s; best valid ExpRate %.2f%% (step %d); test ExpRate %.2f%%; %d skipped steps",
            self.step,
            metrics["wall_time_s"],
            metrics["best_valid_exprate"],
            metrics["best_step"],
            metrics["test_exprate"],
            metrics["skipped_steps"],
        )
        if self.rollback.events:
            last = self.rollback.events[-1]
            log.warning(
                "NOT A CLEAN RUN: it rolled back %d times (last at step %d); lr now %.4g, clip threshold %s",
                len(self.rollback.events),
                last["step"],
                last["lr"],
                last["clip_threshold"],
            )
        self.scalar("test/exprate", test["exprate"], self.step)
        self.finish_logs()
        if self.dist.is_main:
            write_json(self.run_dir / "metrics.json", metrics)
        return metrics


def strict(x):
    """NaN and Inf as the strings "nan", "inf", "-inf": strict JSON (jq, browsers) has no such numbers."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict(v) for v in x]
    return x


def write_json(path: Path, data: dict) -> None:
    """Write strict JSON atomically (temporary file, then rename)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(strict(data), indent=2, default=str, allow_nan=False))
    os.replace(tmp, path)


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
        trainer = Trainer(cfg, overrides, on_eval, parallel_jobs)
        finished = False
        try:
            metrics = trainer.fit()
            finished = not metrics.get("preempted")
            return metrics
        finally:
            trainer.close_loggers(finished)  # a run the guard stopped, or one that crashed, is marked failed
            trainer.dist.cleanup()
