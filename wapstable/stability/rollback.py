"""Automatic remediation (`guard.on_budget_exhausted=rollback`): restore a trusted state, back off, go on.

When the skip budget runs out, a person would restart the job from an earlier checkpoint with a lower learning
rate. This does that inside the run, within bounds (`guard.max_rollbacks`), and loudly: each rollback is a warning,
a row in `metrics.json`, a TensorBoard marker, and part of every checkpoint so that a resumed run keeps its
back-off.

Which states are trusted. The step just before a failure streak may itself have ruined the weights (an lr spike
does its damage in an accepted step, and only the next step overflows), so a state is trusted only once the step
that starts from it has been accepted. The starting state of a run (or the state it resumed from, unless that was
written inside a failure streak) is trusted from step 0 on: a failure in the first steps always has a state to
return to. A snapshot is taken every `guard.snapshot_every` steps and at every regular checkpoint, and kept in
memory; it joins the trusted states when the next step is accepted. The newest trusted state also goes to `checkpoints/trusted.pt` whenever the regular
checkpoint is written, so a checkpoint written during a failure streak never replaces the last good one, and a
resumed run still has it.

A rollback restores the newest trusted state and forgets it together with every newer one: when the first rollback
does not cure the run (the damage may be older than one step), the next one goes further back. The starting state
is the floor: it is never forgotten, so a run can always return to it (with a further back-off each time).
"""

import copy
import logging

import torch

log = logging.getLogger("wapstable")

KEEP = 2  # trusted snapshots kept besides the starting state


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
    """Trusted states, the back-off in force, and the record of rollbacks."""

    def __init__(self, cfg_guard):
        self.enabled = cfg_guard.on_budget_exhausted == "rollback"
        self.every = cfg_guard.snapshot_every
        self.lr_backoff, self.clip_backoff = cfg_guard.lr_backoff, cfg_guard.clip_backoff
        self.max_rollbacks = cfg_guard.max_rollbacks
        self.floor: dict | None = None  # the starting (or resumed) state: never forgotten
        self.floor_source = "starting state"
        self.trusted: list[dict] = []  # newer trusted snapshots, oldest first, at most KEEP
        self.pending: dict | None = None  # the newest snapshot, trusted once the step from it is accepted
        self.written_step: int | None = None  # the step of the state in checkpoints/trusted.pt
        self.lr_scale = 1.0
        self.clip_scale = 1.0
        self.events: list[dict] = []
        self.streak_start: int | None = None  # first step of the current run of skipped steps

    def start(self, state_fn, on_disk: dict | None = None) -> None:
        """Trust the state the run starts from; `on_disk` is the resumed run's checkpoints/trusted.pt."""
        if not self.enabled:
            return
        state = _to_cpu(state_fn())
        if on_disk is not None and on_disk["step"] <= state["step"] and weights_finite(on_disk["model"]):
            self.floor, self.written_step, self.floor_source = on_disk, on_disk["step"], "trusted.pt"
        if self.streak_start is None:  # a state written inside a failure streak waits like a snapshot
            self.trusted = [state] if self.floor is not None else []
            self.floor = self.floor or state
        else:
            self.pending = state

    def note_step(self, step: int, skipped: bool) -> None:
        """Step `step` was accepted or skipped: a snapshot taken just before it is trusted or dropped."""
        if self.pending is not None and self.pending["step"] == step:
            if not skipped:
                self.trust(self.pending)
            self.pending = None
        if not skipped:
            self.streak_start = None
        elif self.streak_start is None:
            self.streak_start = step

    def trust(self, state: dict) -> None:
        if self.floor is None:
            self.floor = state
        else:
            self.trusted = [*self.trusted, state][-KEEP:]

    def maybe_snapshot(self, step: int, state_fn, checkpoint: bool = False) -> None:
        """An in-memory copy of the training state every `guard.snapshot_every` steps and at every regular
        checkpoint (rollback only), outside failure streaks."""
        due = checkpoint or (self.every > 0 and step % self.every == 0)
        if self.enabled and due and self.streak_start is None:
            self.pending = _to_cpu(state_fn())

    def newest(self) -> dict | None:
        """The newest trusted state with finite weights."""
        for state in reversed([s for s in (self.floor, *self.trusted) if s is not None]):
            if weights_finite(state["model"]):
                return state
        return None

    def to_write(self) -> dict | None:
        """The newest trusted state when checkpoints/trusted.pt does not hold it yet."""
        state = self.newest() if self.enabled else None
        if state is None or state["step"] == self.written_step:
            return None
        self.written_step = state["step"]
        return state

    def can_roll_back(self) -> bool:
        return self.enabled and len(self.events) < self.max_rollbacks

    def pick(self) -> dict | None:
        """The state to restore; it and every newer one are forgotten, except the floor."""
        state = self.newest()
        if state is not None:
            self.trusted = [s for s in self.trusted if s["step"] < state["step"]]
        self.pending = None
        return state

    def back_off(self) -> None:
        self.lr_scale *= self.lr_backoff
        self.clip_scale *= self.clip_backoff

    def record(self, event: dict) -> None:
        self.events.append(event)
        self.streak_start = None

    def state_dict(self) -> dict:
        return {
            "lr_scale": self.lr_scale,
            "clip_scale": self.clip_scale,
            "events": list(self.events),
            "streak_start": self.streak_start,
        }

    def load_state_dict(self, state: dict) -> None:
        self.lr_scale = float(state["lr_scale"])
        self.clip_scale = float(state["clip_scale"])
        self.events = list(state["events"])
        self.streak_start = state.get("streak_start")
