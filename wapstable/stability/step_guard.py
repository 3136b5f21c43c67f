"""`StepGuard`: one guarded optimizer step for any PyTorch training loop.

    guard = StepGuard(model, optimizer, clip="inf", max_norm=2.0, max_consecutive_skips=5, anomaly_dir="anomalies")
    guard = StepGuard(model, optimizer, clip=NormClip(max_norm=5.0))   # or a clip rule (wapstable.stability.clip)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        result = guard.step(loss, batch=(x, y))   # backward, one finite decision, clip, step or skip
        if result.skipped:
            print(result.reason)

`step` runs backward (through a GradScaler if given), computes the total gradient norm, and makes one decision
with one host synchronisation: the loss, the norm, the non-finite flag and the clip flag are read together. A
step whose loss or gradients are NaN/Inf (or, with a `SpikeDetector`, a loss or grad-norm spike) is skipped:
neither the optimizer nor the scheduler is called, BatchNorm's running statistics are put back as they were
before the forward, and the gradients are zeroed, so parameters, optimizer state, schedule and buffers are
bit-identical to before. A taken step is clipped by the clip rule (none, norm, value, inf, agc, autoclip, or one of
one's own) and stepped. Skips count against a budget (`max_consecutive_skips`, `max_total_skips`); past it, `step` raises
`TrainingStopped`, or, with `raise_on_exhausted=False`, says so in `StepResult.budget_exhausted` and lets the
caller decide (the trainer rolls back). Each skip can write an anomaly checkpoint: the model and optimizer state,
the RNG state from before the forward, the offending batch, and per-layer gradient figures.

The trainer (`wapstable.train.loop`) runs its steps through this same object.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from wapstable.checkpoint import rng_state, save_checkpoint
from wapstable.errors import TrainingStopped
from wapstable.stability.clip import AutoClipHistory, ClipRule, plan_clip, rule_for
from wapstable.stability.guard import (
    SkipBudget,
    SpikeDetector,
    count_nonfinite_grads,
    grad_figures,
    nonfinite_flag,
)


class Outcome(StrEnum):
    ACCEPTED = "accepted"
    NONFINITE = "nonfinite"  # NaN/Inf loss or gradients: skipped, counts against the budget
    SPIKE = "spike"  # a loss or grad-norm spike (SpikeDetector): skipped, counts against the budget
    SCALER = "scaler"  # fp16 overflow: the GradScaler lowers its scale; skipped, not counted


@dataclass(frozen=True)
class StepResult:
    """What one guarded step did, as Python numbers."""

    step: int
    loss: float
    grad_norm: float  # before clipping, in the clip mode's norm
    outcome: Outcome = Outcome.ACCEPTED
    clipped: bool = False
    reason: str | None = None  # why the step was skipped
    anomaly_path: Path | None = None  # the anomaly checkpoint this skip wrote
    budget_exhausted: str | None = None  # why the skip budget is spent (raise_on_exhausted=False)

    @property
    def skipped(self) -> bool:
        return self.outcome is not Outcome.ACCEPTED

    @property
    def counted(self) -> bool:
        """A skip that counts against the budget (not the GradScaler's own)."""
        return self.outcome in (Outcome.NONFINITE, Outcome.SPIKE)


def to_cpu(batch):
    """A batch (a tensor, or tuples, lists, dicts and named tuples of them) on the CPU, for a checkpoint."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().cpu()
    if isinstance(batch, dict):
        return {k: to_cpu(v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return [to_cpu(v) for v in batch]
    return batch


class StepGuard:
    """Backward, the finite decision, clipping and the optimizer step (or a bit-exact skip), for any model.

    clip: a clip rule (`wapstable.stability.clip`: `NormClip(max_norm=5.0)`, or a rule of one's own), or the name of
    one, none | norm | value | inf | agc | autoclip, with its threshold as keywords: `max_norm` (norm, inf;
    `norm_type` 1 or 2 for norm), `value` (value), `factor`/`eps`/`skip` (agc: parameters left alone, e.g. an
    output layer), `percentile` (autoclip, over `history`). `scheduler` is stepped after each taken step; `scaler` is a
    `torch.amp.GradScaler`. `reduce_flag` (DDP: an all-reduce "any") makes every rank take the same decision, and
    `agree` does the same for a spike seen on one rank. `stats` (a `GradStats`) gets the per-layer figures before
    clipping and after the step. `anomaly_dir` turns on the anomaly checkpoints (`step-N.pt`, at most
    `max_anomaly_checkpoints`); `write_anomaly(result, batch, rng_before)` replaces the default writer.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler=None,
        clip: str | ClipRule = "norm",
        max_norm: float = 1.0,
        norm_type: float = 2.0,
        value: float = 1.0,
        factor: float = 0.01,
        eps: float = 1e-3,
        skip=(),
        percentile: float = 10.0,
        history: AutoClipHistory | None = None,
        scaler: torch.amp.GradScaler | None = None,
        skip_nonfinite: bool = True,
        spikes: SpikeDetector | None = None,
        max_consecutive_skips: int = 5,
        max_total_skips: int = 1000,
        raise_on_exhausted: bool = True,
        anomaly_dir: str | Path | None = None,
        max_anomaly_checkpoints: int = 3,
        write_anomaly: Callable | None = None,
        stats=None,
        reduce_flag: Callable[[torch.Tensor], torch.Tensor] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.clip = rule_for(
            clip,
            max_norm=max_norm,
            norm_type=norm_type,
            value=value,
            factor=factor,
            eps=eps,
            skip=skip,
            percentile=percentile,
            history=history,
        )
        self.skip_nonfinite, self.spikes = skip_nonfinite, spikes
        self.budget = SkipBudget(max_consecutive_skips, max_total_skips)
        self.raise_on_exhausted = raise_on_exhausted
        self.anomaly_dir = Path(anomaly_dir) if anomaly_dir is not None else None
        self.max_anomaly_checkpoints = max_anomaly_checkpoints
        self.write_anomaly = write_anomaly or (self._write_anomaly if anomaly_dir is not None else None)
        self.anomaly_checkpoints = 0
        self.stats = stats
        self.reduce_flag, self.agree = reduce_flag, agree
        self.steps = 0  # the index of the next step
        self.accepted = self.clipped = self.scaler_skips = 0
        self.buffers = list(model.buffers())
        self.saved_buffers = [b.detach().clone() for b in self.buffers]
        self.rng_before = rng_state() if self.write_anomaly is not None else None

    def refresh(self) -> None:
        """Take the model's buffers and the RNG as they are now as "before the next forward" (after loading a
        state into the model, or anything else between steps that changes them)."""
        if self.buffers:
            torch._foreach_copy_(self.saved_buffers, self.buffers)
        if self.write_anomaly is not None:
            self.rng_before = rng_state()

    @property
    def norm_type(self) -> float:
        """The norm of the total gradient norm the guard computes and reports (the clip rule's)."""
        return self.clip.norm_type

    def set_clip(self, rule: ClipRule) -> None:
        """Clip by `rule` from the next step (a rollback's backed-off copy of the rule in force)."""
        self.clip = rule

    def clip_threshold(self) -> float | None:
        """The global-norm threshold in force: max_norm for norm and inf, autoclip's current percentile of the
        norm history (a host sync); None for value, agc and none, which do not compare with the global norm."""
        return self.clip.threshold()

    def counters(self) -> dict:
        """How many steps were accepted, clipped and skipped by the GradScaler, and anomaly files written."""
        return {
            "accepted": self.accepted,
            "clipped": self.clipped,
            "scaler_skips": self.scaler_skips,
            "anomaly_checkpoints": self.anomaly_checkpoints,
        }

    def load_counters(self, counters: dict) -> None:
        self.accepted, self.clipped, self.scaler_skips, self.anomaly_checkpoints = (
            int(counters[k]) for k in ("accepted", "clipped", "scaler_skips", "anomaly_checkpoints")
        )

    def step(
        self, loss: torch.Tensor, batch=None, rng_before: dict | None = None, before_update=None
    ) -> StepResult:
        """Backward of `loss`, then the optimizer step or a skip. `rng_before` is the RNG state from before the
        forward (default: as it was at the end of the previous step); `before_update()` runs just before a taken
        step's optimizer step (e.g. to scale its lr)."""
        step, model = self.steps, self.model
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        total_norm, plan = plan_clip(self.params, self.clip)
        bad = nonfinite_flag(loss, total_norm)
        if self.reduce_flag is not None:
            bad = self.reduce_flag(bad)  # every rank takes the same decision
        # The one host sync of a step: loss, norm, the finite decision and the clip flag, read together.
        loss_value, norm_value, bad_value, clipped_value = torch.stack(
            [loss.detach().float(), total_norm.float(), bad.float(), plan.flag.float()]
        ).tolist()

        outcome, reason = Outcome.ACCEPTED, None
        if bad_value and self.skip_nonfinite:
            what = "loss" if not math.isfinite(loss_value) else "gradients"
            n_bad, _ = count_nonfinite_grads(model.named_parameters())
            reason = f"non-finite {what} ({n_bad} gradient tensors non-finite)"
            fp16_overflow = what == "gradients" and self.scaler and self.scaler.get_scale() >= 1.0
            outcome = Outcome.SCALER if fp16_overflow else Outcome.NONFINITE
        elif self.spikes is not None and not bad_value:
            reason = self.spikes.check(loss_value, norm_value)
            if self.agree is not None and self.agree(reason is not None) and reason is None:
                reason = "loss or grad-norm spike on another rank"  # each rank sees its own loss
            outcome = Outcome.SPIKE if reason is not None else Outcome.ACCEPTED
        if self.stats is not None:  # before clipping: the gradients as backward left them
            self.stats.capture(step, model, anomalous=bool(bad_value) or reason is not None)

        if outcome is Outcome.ACCEPTED:
            plan.apply()
            if before_update is not None:
                before_update()
            if self.scaler:
                if bad_value:  # not skipped (skip_nonfinite off): the scaler's own check skips the update
                    self.scaler.step(self.optimizer)
                else:  # every gradient is finite, read in the sync above: scaler.step would read it again
                    self.optimizer.step()
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            if self.spikes is not None:
                self.spikes.update(loss_value, norm_value)
            clipped = bool(clipped_value)
            result = StepResult(step, loss_value, norm_value, clipped=clipped)
            self.budget.record(False)
            self.accepted += 1
            self.clipped += clipped
        else:
            if self.buffers:  # BatchNorm's running statistics as they were before this forward
                with torch.no_grad():
                    torch._foreach_copy_(self.buffers, self.saved_buffers)
            if self.scaler:
                self.scaler.update()
            result = StepResult(step, loss_value, norm_value, outcome, reason=reason)
            if result.counted:
                self.budget.record(True, spike=outcome is Outcome.SPIKE)
                result = self._after_skip(result, batch, rng_before or self.rng_before)
            else:
                self.scaler_skips += 1
        if self.stats is not None:
            self.stats.finish(step, result, threshold=self.clip_threshold)
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if outcome is Outcome.ACCEPTED and self.buffers:
            torch._foreach_copy_(self.saved_buffers, self.buffers)
        if self.write_anomaly is not None and rng_before is None:  # a caller that passes its own needs none
            self.rng_before = rng_state()
        if result.budget_exhausted and self.raise_on_exhausted:
            where = f"; anomaly checkpoints are in {self.anomaly_dir}" if self.anomaly_dir else ""
            raise TrainingStopped(f"{result.budget_exhausted} at step {step}{where}")
        return result

    def _after_skip(self, result: StepResult, batch, rng_before) -> StepResult:
        path = None
        exhausted = self.budget.exhausted()
        # Past the cap, the step that spends the budget still gets one: it is the one a user replays first.
        room = self.anomaly_checkpoints < self.max_anomaly_checkpoints or (
            exhausted and not self.anomaly_checkpoints
        )
        if self.write_anomaly is not None and room:
            path = self.write_anomaly(result, batch, rng_before)
            self.anomaly_checkpoints += 1
        return StepResult(
            result.step,
            result.loss,
            result.grad_norm,
            result.outcome,
            reason=result.reason,
            anomaly_path=path,
            budget_exhausted=exhausted,
        )

    def _write_anomaly(self, result: StepResult, batch, rng_before) -> Path:
        """`anomaly_dir/step-N.pt`: model and optimizer before the step, the RNG before its forward, the batch,
        and per-layer gradient norms and non-finite counts."""
        grad_norms, per_layer_bad = grad_figures(self.model)
        state = {
            "step": result.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": rng_before,
            "anomaly": {
                "step": result.step,
                "reason": result.reason,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "batch": to_cpu(batch),
                "grad_norms": grad_norms,
                "nonfinite_counts": per_layer_bad,
            },
        }
        return save_checkpoint(state, self.anomaly_dir / f"step-{result.step}.pt")

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "budget": self.budget.state_dict(),
            "spikes": self.spikes.state_dict() if self.spikes is not None else None,
            "clip": self.clip.state_dict(),
            "counters": self.counters(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.budget.load_state_dict(state["budget"])
        if self.spikes is not None and state.get("spikes") is not None:
            self.spikes.load_state_dict(state["spikes"])
        # a state_dict from before the clip rules: AutoClip's history under "history"
        self.clip.load_state_dict(state["clip"] if "clip" in state else {"history": state.get("history")})
        if "counters" not in state:  # a state_dict of the first release: counts and anomaly_checkpoints apart
            state = {
                **state,
                "counters": {**state["counts"], "anomaly_checkpoints": state["anomaly_checkpoints"]},
            }
        self.load_counters(state["counters"])
        self.refresh()
