"""One training step of the run: a batch from the stream, the model's forward with the configured fault, then
`StepGuard.step` (backward, the finite decision, clipping, the optimizer step or a bit-exact skip); after a skip,
the localisation of the first anomaly, and when the skip budget is spent a rollback or the stop."""

import json
import logging

from wapstable.checkpoint import rng_state
from wapstable.data.pixel_aug import active, augment_batch
from wapstable.data.warp import warp_batch
from wapstable.errors import TrainingStopped
from wapstable.model.loss import forward_loss
from wapstable.stability.step_guard import Outcome, StepResult

log = logging.getLogger("wapstable")


class TrainingStep:
    """The step methods of `Trainer` (mixed into it; they read the trainer's components)."""

    def train_one(self) -> StepResult:
        """Draw a batch and take one guarded step; a skip is warned about, and may roll back or stop the run."""
        self.stream_before = self.stream.state_dict()  # where an anomaly checkpoint's replay starts
        batch = self.stream.next().to(self.device)
        if (
            self.cfg.data.get("warp", 0) > 0
        ):  # before the RNG snapshot: an anomaly checkpoint holds the warped batch
            batch = warp_batch(batch, self.cfg.data.warp)
        aug = self.cfg.data.get("pixel_aug")
        if active(aug):  # the same: the augmented batch is the one a replay reads
            batch = augment_batch(batch, aug.scale, aug.pen, aug.blur, aug.binarize)
        rng_before = rng_state() if self.cfg.guard.checkpoint_on_anomaly else None
        result = self.train_step(batch, rng_before)
        self.fault.preempt(self.step)
        self.rollback.note_step(self.step, result.counted)
        if result.skipped:
            self.handle_skip(result)
        self.step += 1
        return result

    def train_step(self, batch, rng_before: dict | None = None) -> StepResult:
        """The model's forward (with the configured fault), then the guarded step: backward, the finite
        decision, clipping, and the optimizer and scheduler step or a bit-exact skip."""
        step = self.step
        self.model.scale_energies(self.fault.energy_scale(step))
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
        if not result.budget_exhausted:
            return
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
        """Scale the schedule's base lrs by the rollback back-off in force, set the current lrs to match, and
        tighten the guard's clip threshold by the clip back-off."""
        self.scheduler.base_lrs = [lr * self.rollback.lr_scale for lr in self.base_lrs]
        # This step's lr from the new base lrs; the scheduler's next step() computes the same (the trainer reads the
        # lr from the optimizer, never the scheduler's private copy).
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * factor
        self.guard.set_clip(self.clip.backed_off(self.rollback.clip_scale))

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
            "clip_threshold": self.guard.clip.limit(),
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
