"""Automatic remediation (`guard.on_budget_exhausted=rollback`): restore the last good state, back off, go on.

When the skip budget runs out, a person would restart the job from an earlier checkpoint with a lower learning
rate. This does that inside the run, within bounds (`guard.max_rollbacks`), and loudly: each rollback is a warning,
a row in `metrics.json`, a TensorBoard marker, and part of every checkpoint so that a resumed run keeps its
back-off.

A state is "good" when it was taken before the last accepted step preceding the failure streak: the step just
before the first skip may itself have ruined the weights (an lr spike does its damage in an accepted step), so
a snapshot taken right after it is not trusted. Two in-memory snapshots are kept, so one always qualifies.
"""

import copy
import logging
import math

import torch

log = logging.getLogger("wapstable")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return copy.deepcopy(obj)


def weights_finite(model_state: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in model_state.values() if v.is_floating_point())


class Rollback:
    """Snapshots, the back-off in force, and the record of rollbacks."""

    def __init__(self, cfg_guard):
        self.enabled = cfg_guard.on_budget_exhausted == "rollback"
        self.every = cfg_guard.snapshot_every
        self.lr_backoff, self.clip_backoff = cfg_guard.lr_backoff, cfg_guard.clip_backoff
        self.max_rollbacks = cfg_guard.max_rollbacks
        self.snapshots: list[dict] = []  # at most two, oldest first
        self.lr_scale = 1.0
        self.clip_scale = 1.0
        self.events: list[dict] = []
        self.streak_start: int | None = None  # first step of the current run of skipped steps

    def note_step(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.streak_start = None
        elif self.streak_start is None:
            self.streak_start = step

    def maybe_snapshot(self, step: int, state_fn) -> None:
        """Keep an in-memory copy of the training state every `guard.snapshot_every` steps (rollback only)."""
        if self.enabled and self.every > 0 and step % self.every == 0 and self.streak_start is None:
            self.snapshots = [*self.snapshots[-1:], _to_cpu(state_fn())]

    def can_roll_back(self) -> bool:
        return self.enabled and len(self.events) < self.max_rollbacks

    def pick(self, checkpoint_state: dict | None) -> tuple[dict, str] | None:
        """The newest trusted state among the snapshots and the last regular checkpoint, with its source."""
        limit = (self.streak_start if self.streak_start is not None else math.inf) - 1
        candidates = [(s, "snapshot") for s in self.snapshots]
        if checkpoint_state is not None:
            candidates.append((checkpoint_state, "checkpoint"))
        good = [(s, src) for s, src in candidates if s["step"] <= limit and weights_finite(s["model"])]
        if not good:
            return None
        return max(good, key=lambda c: c[0]["step"])

    def back_off(self) -> None:
        self.lr_scale *= self.lr_backoff
        self.clip_scale *= self.clip_backoff

    def record(self, event: dict) -> None:
        self.events.append(event)
        self.streak_start = None

    def state_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "clip_scale": self.clip_scale, "events": list(self.events)}

    def load_state_dict(self, state: dict) -> None:
        self.lr_scale = float(state["lr_scale"])
        self.clip_scale = float(state["clip_scale"])
        self.events = list(state["events"])
