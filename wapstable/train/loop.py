"""The run: `train(cfg)` trains as the config says and returns the metrics.

`Trainer` is put together from named parts, each in its own module, none of which calls back into it:
- `parts.RunParts`: the components built from the config (data, model, optimizer, schedule, stream, guard);
- `record.RunRecord`: what the run has done (step, clock, validations, best, anomalies);
- `checkpointer.Checkpointer`: the run's state, saved and loaded;
- `evaluator.Evaluator`: validation and the final test;
- `runlog.RunLog`: loggers, progress bar, train.log;
- `summary`: metrics.json.
The trainer takes the steps and decides what follows each one (evaluation, checkpoint, rollback, stop). Training
stages (a pretraining, then the run) are `stages.train`'s.
"""

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from wapstable.checkpoint import load_checkpoint, rng_state
from wapstable.data.normalize import read_factors
from wapstable.data.pixel_aug import active, augment_batch
from wapstable.data.warp import warp_batch
from wapstable.errors import TrainingStopped, UserError
from wapstable.model.loss import forward_loss, guide_weight
from wapstable.stability.clip import build_clip
from wapstable.stability.step_guard import Outcome, StepResult
from wapstable.train import distributed
from wapstable.train.build import load_resume, validate_config
from wapstable.train.checkpointer import Checkpointer
from wapstable.train.evaluator import Evaluator
from wapstable.train.loggers import GUIDE_SCALARS, SYMBOL_MAP_SCALARS
from wapstable.train.parts import RunParts, build_parts
from wapstable.train.record import RunRecord
from wapstable.train.runlog import RunLog
from wapstable.train.signals import StopSignals
from wapstable.train.summary import log_done, test_metrics, training_metrics, write_json
from wapstable.train.threads import CoreShare, resolve_threads

log = logging.getLogger("wapstable")


class Trainer:
    """A run built from `cfg`: `fit()` trains it and returns its metrics.

    The components (`model`, `optimizer`, `scheduler`, `scaler`, `stream`, `clip`, `guard`, `budget`, `spikes`,
    `device`, `dist`, ...) are `self.parts`'s, read through attributes of the same names; `step`, `anomalies` and
    `localization` are the record's. Tools that drive a trainer step by step (scripts/bench.py,
    scripts/gpu_check.py, tests) use `train_step`, `go_to_step`, `restart`, `use_distributed` and `write_anomaly`.
    """

    def __init__(
        self,
        cfg: DictConfig,
        overrides: list[str] | None = None,
        on_eval: Callable[[dict], bool] | None = None,
        parallel_jobs: int = 1,
    ):
        run_dir = Path(cfg.run_dir)
        cfg, resume_state, self.resume_path = load_resume(cfg, run_dir, overrides)
        self.fresh_over_existing = self.resume_path is None and (run_dir / "checkpoints" / "last.pt").exists()
        validate_config(cfg)
        threads = resolve_threads(cfg.trainer.threads, parallel_jobs)
        # auto: shared with the other trainers running on these cores, re-counted during fit
        self.cores = CoreShare(parallel_jobs) if cfg.trainer.threads == "auto" else contextlib.nullcontext()
        if threads > 0:
            torch.set_num_threads(threads)
        self.cfg, self.run_dir, self.on_eval = cfg, run_dir, on_eval
        self.record = RunRecord()
        self.stream_before: dict | None = None  # the stream's position before the current step's batch
        self.parts: RunParts = build_parts(
            cfg,
            resume_state,
            self.resume_path,
            time_done=lambda: self.record.time_done(cfg.trainer.max_minutes),
            write_anomaly=self.write_anomaly,
        )
        self.checkpointer = Checkpointer(self.parts, self.record)
        self.evaluator = Evaluator(self.parts)
        self.runlog = RunLog(cfg, run_dir, self.parts.dist.is_main)
        if resume_state is not None:
            self.checkpointer.load(resume_state)

    # ---- the components and the record, by name ----
    model = property(lambda self: self.parts.model)
    ddp_model = property(lambda self: self.parts.ddp_model)
    optimizer = property(lambda self: self.parts.optimizer)
    scheduler = property(lambda self: self.parts.scheduler)
    scaler = property(lambda self: self.parts.scaler)
    stream = property(lambda self: self.parts.stream)
    clip = property(lambda self: self.parts.clip)
    guard = property(lambda self: self.parts.guard)
    budget = property(lambda self: self.parts.budget)
    spikes = property(lambda self: self.parts.spikes)
    rollback = property(lambda self: self.parts.rollback)
    device = property(lambda self: self.parts.device)
    dist = property(lambda self: self.parts.dist)
    vocab = property(lambda self: self.parts.vocab)
    splits = property(lambda self: self.parts.splits)
    ink_stats = property(lambda self: self.parts.ink_stats)
    step = property(lambda self: self.record.step)
    anomalies = property(lambda self: self.record.anomalies)
    localization = property(lambda self: self.record.localization)

    # ---- the public API of the tools that drive a trainer step by step ----
    def state(self) -> dict:
        """The run's state as a checkpoint holds it."""
        return self.checkpointer.state()

    def restart(self, state: dict, step: int = 0) -> None:
        """Put the training state back to `state` (weights, optimizer, schedule, GradScaler; the clip rule's state as
        a fresh rule has it) and number the next step `step`: every timed block of the benchmark starts so."""
        self.checkpointer.restore_training(state)
        self.clip.load_state_dict(build_clip(self.cfg.clip).state_dict())
        self.go_to_step(step)
        self.model.zero_grad(set_to_none=True)

    def go_to_step(self, step: int) -> None:
        """Number the next step `step` (what decides whether a fault fires, statistics are written, an evaluation
        runs), with nothing else changed."""
        self.record.step = int(step)

    def use_distributed(self, dist: distributed.Dist) -> None:
        """Train through `dist` from the next step: the model wrapped by it, and the guard's one decision and spike
        agreement taken over its ranks."""
        self.parts.use_distributed(dist)

    def write_anomaly(self, result: StepResult, batch, rng_before: dict) -> Path | None:
        """anomalies/step-N.pt for the current step (the guard calls it on a skip)."""
        return self.checkpointer.write_anomaly(result, batch, rng_before, self.stream_before)

    # ---- the loop ----
    def fit(self) -> dict:
        """Guarded steps, each followed by its events (consistency check, evaluation, snapshot, checkpoint), until
        trainer.max_steps, the time budget or a stop signal; then the final test (or, after a signal, last.pt and
        the hand-over to the cluster's requeue)."""
        t = self.cfg.trainer
        with self.cores:
            self.begin()
            signals = StopSignals()
            share = getattr(self.cores, "update", lambda: None)
            self.runlog.open_progress(self.step)
            try:
                with self.anomaly_detection(), signals:
                    time_up = self.time_up()
                    while self.step < t.max_steps and not time_up:
                        share()
                        lr = self.optimizer.param_groups[0][
                            "lr"
                        ]  # the step's own: its scheduler steps after it
                        self.log_step(self.train_one(), lr)
                        time_up = self.after_step()
                        if self.record.pruned:  # a sweep's pruner gave up on this trial at its evaluation
                            return self.pruned_metrics()
                        if self.dist.agree(
                            signals.received is not None
                        ):  # all ranks stop after the same step
                            return self.stop_for(signals)
            finally:
                self.runlog.close_progress()
            return self.final_metrics()

    def begin(self) -> None:
        """Refuse to overwrite another run, create the run directory, open the logs, trust the starting state."""
        cfg = self.cfg
        if self.fresh_over_existing:  # checked after every other input, so those errors come first
            raise UserError(
                f"{self.run_dir} already holds a run (checkpoints/last.pt); continue it with resume=auto, or "
                "start a new one in another hydra.run.dir"
            )
        self.record.start_clock()
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.vocab.save(self.run_dir / "vocab.txt")
            report = self.splits.report
            if any(report.values()):  # a data set read from files: what was used, what was skipped and why
                write_json(
                    self.run_dir / "data_report.json",
                    {**report, "samples": {k: len(v) for k, v in self.splits.items()}},
                )
        extra = list(GUIDE_SCALARS) if getattr(self.model, "guide", None) else []
        if getattr(self.model, "symbol_head", None) is not None:
            extra += SYMBOL_MAP_SCALARS
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        # the gradient statistics log through the same loggers
        self.parts.stats.loggers = self.runlog.open(config, extra)
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
        self.rollback.start(self.state, on_disk=self.checkpointer.trusted_on_disk(self.resume_path))

    def anomaly_detection(self):
        return torch.autograd.detect_anomaly() if self.cfg.guard.detect_anomaly else contextlib.nullcontext()

    def time_up(self) -> bool:
        """Whether the wall-clock budget is spent, the same answer on every rank."""
        max_minutes = self.cfg.trainer.max_minutes
        return max_minutes > 0 and self.dist.agree(self.record.time_done(max_minutes) >= 1.0)

    # ---- one step ----
    def train_one(self) -> StepResult:
        """Draw a batch and take one guarded step; a skip is warned about, and may roll back or stop the run."""
        self.stream_before = self.stream.state_dict()  # where an anomaly checkpoint's replay starts
        batch = self.stream.next().to(self.device)
        data = self.cfg.data
        if data.get("warp", 0) > 0:  # before the RNG snapshot: an anomaly checkpoint holds the warped batch
            batch = warp_batch(batch, data.warp)
        aug = data.get("pixel_aug")
        if active(aug):  # the same: the augmented batch is the one a replay reads
            batch = augment_batch(batch, aug.scale, aug.pen, aug.blur, aug.binarize)
        rng_before = rng_state() if self.cfg.guard.checkpoint_on_anomaly else None
        result = self.train_step(batch, rng_before)
        if self.parts.ema is not None and not result.skipped:
            self.parts.ema.update(self.model)
        self.parts.fault.preempt(self.step)
        self.rollback.note_step(self.step, result.counted)
        if result.skipped:
            self.handle_skip(result)
        self.record.step += 1
        return result

    def train_step(self, batch, rng_before: dict | None = None) -> StepResult:
        """The model's forward (with the configured fault), then the guarded step: backward, the finite
        decision, clipping, and the optimizer and scheduler step or a bit-exact skip."""
        step, fault = self.step, self.parts.fault
        self.model.scale_energies(fault.energy_scale(step))
        self.model.train()
        loss = forward_loss(self.ddp_model, batch, fault, step, self.cfg.trainer.precision)
        lr_mult = fault.lr_multiplier(step)

        def spike_lr():  # lr_spike: this step's lr times fault.scale; the scheduler's step resets it
            for group in self.optimizer.param_groups:
                group["lr"] *= lr_mult

        self.guard.steps = step
        return self.guard.step(
            loss, batch=batch, rng_before=rng_before, before_update=spike_lr if lr_mult != 1.0 else None
        )

    def log_step(self, out: StepResult, lr: float) -> None:
        """One step's scalars and progress; `lr` is the learning rate the step used (read before its scheduler
        stepped)."""
        # the attention guide's and the symbol map's unweighted losses of this step (parts of out.loss), when on
        values = [getattr(self.model, name, None) for name in ("guide_value", "symbol_map_value")]
        guide, symbols = (float(v) if v is not None else None for v in values)
        self.runlog.step(out, self.step, lr, guide, symbols, self.budget.total)
        if self.dist.is_main and getattr(self.model, "guide", None):
            self.runlog.scalar("train/guide_weight", guide_weight(self.model.guide, self.step), self.step)

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
        g = cfg.guard
        if path is not None and self.localization is None and g.localize and g.checkpoint_on_anomaly:
            self.localize(path)
        if not result.budget_exhausted:
            return
        reason = result.budget_exhausted
        if self.rollback.can_roll_back() and self.roll_back(reason):
            return
        if self.rollback.events:
            reason += f" after {len(self.rollback.events)} rollbacks (guard.max_rollbacks={g.max_rollbacks})"
        self.checkpointer.save("last")
        self.runlog.flush()
        raise TrainingStopped(
            f"{reason} at step {self.step}; anomaly checkpoints are in {self.run_dir / 'anomalies'}, "
            f"replay one with `python scripts/replay_anomaly.py PATH`"
        )

    def localize(self, path: Path) -> None:
        """Replay the first anomaly checkpoint at once and log the first module and op that went non-finite."""
        from wapstable.stability.replay import replay, summarize

        try:
            report = replay(load_checkpoint(path), self.device)
        except Exception as e:  # a failed diagnosis must not end the run it diagnoses
            log.warning("localisation of %s failed: %s", path, e)
            return
        self.record.localization = {"checkpoint": str(path), **report}
        log.warning("localisation: %s", summarize(report))

    def roll_back(self, reason: str) -> bool:
        """Restore the newest trusted state, back off lr and clip threshold, keep the data stream going."""
        rollback = self.rollback
        state = rollback.pick()
        if state is None:
            log.error("rollback: no state from before the failures to return to")
            return False
        source = rollback.floor_source if state is rollback.floor else "snapshot"
        self.checkpointer.restore_training(state)
        rollback.back_off()
        self.checkpointer.apply_backoff()
        self.budget.consecutive = 0
        event = {
            "step": self.step,
            "restored_step": int(state["step"]),
            "source": source,
            "reason": reason,
            "lr": self.optimizer.param_groups[0]["lr"],
            "clip_threshold": self.guard.clip.limit(),
            "batches_skipped": self.step + 1 - int(state["step"]),
        }
        rollback.record(event)
        log.warning(
            "ROLLBACK %d/%d at step %d: %s; restored the %s of step %d, lr now %.4g, clip threshold %s, "
            "%d batches skipped",
            len(rollback.events),
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
        self.runlog.scalar("guard/rollback", len(rollback.events), self.step + 1)
        self.runlog.text("guard/rollbacks", json.dumps(event), self.step + 1)
        return True

    # ---- after each step ----
    def after_step(self) -> bool:
        """The events after a step: consistency check, snapshot, evaluation and the sweep's pruner, checkpoint;
        returns whether the time budget is spent."""
        t, step = self.cfg.trainer, self.step
        if self.dist.should_check(step, t.consistency_every):
            self.dist.check_consistency(self.model, step)
        time_up = self.time_up()
        last = step == t.max_steps or time_up
        if time_up:
            self.record.stopped_by_time = True
            self.runlog.say(f"trainer.max_minutes={t.max_minutes:g} spent: training ends at step {step}")
        checkpoint_now = step % t.checkpoint_every == 0 or last
        self.rollback.maybe_snapshot(step, self.state, checkpoint_now)  # on every rank
        if step % t.eval_every == 0 or last:
            record = self.validate()
            self.record.pruned = self.ask_pruner(record) and not last  # a finished run is a result
        if checkpoint_now:
            self.checkpointer.save("last")
        return time_up

    def validate(self) -> dict:
        """Read the validation split, log it, keep best.pt."""
        record = self.evaluator.validate(self.step)
        self.runlog.validation(record)
        n = self.cfg.stats.attention_images
        chosen = list(self.splits["valid"][:n]) if n > 0 else []
        self.parts.stats.seconds += self.runlog.attention(
            self.parts.eval_model, chosen, self.vocab, self.cfg.decode.max_len, self.step
        )
        if self.record.add_eval(record):
            self.checkpointer.save("best")
        return record

    def ask_pruner(self, record: dict) -> bool:
        """Hand an evaluation to `on_eval` (a sweep's pruner, on the main rank); True on every rank if it says stop."""
        if self.on_eval is None:
            return False
        return self.dist.agree(self.dist.is_main and bool(self.on_eval(record)))

    # ---- the end of a run ----
    def stop_for(self, signals: StopSignals) -> dict:
        """SIGTERM or the preemption signal: last.pt now, then submitit's requeue (or the caller's exit code)."""
        self.checkpointer.save("last")
        log.warning("%s: checkpoint written at step %d; resume with resume=auto", signals.name, self.step)
        self.runlog.flush()
        signals.hand_over()  # under submitit: requeue the job and exit
        return {"stopped_at": self.step, "preempted": True, "exit_code": signals.exit_code}

    def pruned_metrics(self) -> dict:
        """A pruned trial's figures (no test evaluation: the sweep has given up on it), in metrics.json too."""
        metrics = {**training_metrics(self.record, self.parts), "pruned": True}
        log.info(
            "pruned by the sweep at step %d: valid ExpRate %.2f%% (best %.2f%%)",
            self.step,
            self.record.evals[-1]["exprate"],
            self.record.best.exprate,
        )
        return self.finish(metrics)

    def final_metrics(self) -> dict:
        """The range the best checkpoint reads (data.read_range), the test evaluation of it (beam
        decode.final_beam_size), then metrics.json."""
        best = self.run_dir / "checkpoints" / "best.pt"
        read = self.record_read_range(best)
        sets = self.evaluator.test(best)
        metrics = {**training_metrics(self.record, self.parts), **read, **test_metrics(sets, self.cfg.decode)}
        log_done(metrics, sets, self.rollback.events)
        self.runlog.scalar("test/exprate", metrics["test_exprate"], self.step)
        return self.finish(metrics)

    def record_read_range(self, best: Path) -> dict:
        """data.read_range: the symbol sizes the best model reads within its tolerance, measured on the validation
        split at its scales and written into best.pt and last.pt as the ink_stats that evaluate.py and predict.py
        normalise images to (the range it was shown stays where it reads nothing at scale 1); {} when off."""
        rr = self.cfg.data.get("read_range")
        if rr is None or not rr.scales or self.parts.ink_stats is None:
            return {}
        readings = self.evaluator.read_scales(best, rr.scales)
        shown = ", ".join(f"{f:g}: {r:.2f}%" for f, r in readings.items())
        out = {"read_scales": {f"{f:g}": r for f, r in readings.items()}}
        factors = read_factors(readings, float(rr.tolerance))
        if factors is None:
            log.warning(
                "data.read_range: the model reads none of the validation split (%s); the range it was "
                "shown is recorded",
                shown,
            )
            return out
        lo, hi = factors
        self.parts.ink_stats = self.parts.ink_stats.rescaled(factors)
        self.checkpointer.record_ink_stats()
        log.info(
            "data.read_range: valid ExpRate (greedy) at scale %s; read within %g points from %g to %g: "
            "recorded %s",
            shown,
            rr.tolerance,
            lo,
            hi,
            self.parts.ink_stats,
        )
        return {**out, "read_factors": [lo, hi], "ink_stats": self.parts.ink_stats.as_dict()}

    def finish(self, metrics: dict) -> dict:
        self.runlog.flush()
        if self.dist.is_main:
            write_json(self.run_dir / "metrics.json", metrics)
        return metrics

    def close(self, finished: bool) -> None:
        """Close the loggers (a run that did not finish is marked failed) and leave the process group."""
        self.runlog.close(finished)
        self.parts.stats.loggers = None
        self.dist.cleanup()
