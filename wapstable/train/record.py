"""The run's own record: the step count, the clock, the validations, the best ExpRate, the anomalies. It is what a
checkpoint saves besides the components' states, and what `metrics.json` summarises; it calls nothing."""

import time
from dataclasses import dataclass, field
from typing import NamedTuple


class Best(NamedTuple):
    """The best validation ExpRate so far and the step it was reached at (-1 before the first evaluation)."""

    exprate: float = -1.0
    step: int = -1


@dataclass
class RunRecord:
    """What the run has done so far.

    - `step`: the number of the next step (steps done, skipped ones included);
    - `best`, `evals`: the best validation and every validation's record (step, exprate, wer, loss);
    - `anomalies`: one record per anomaly checkpoint; `localization`: the first anomaly's replay report;
    - `stopped_by_time`, `pruned`: why the loop ended early (the time budget; a sweep's pruner);
    - the clock: `elapsed_before` (the training seconds of the runs this one resumes) and `start_time`.
    """

    step: int = 0
    best: Best = Best()
    evals: list[dict] = field(default_factory=list)
    anomalies: list[dict] = field(default_factory=list)
    localization: dict | None = None
    stopped_by_time: bool = False
    pruned: bool = False
    elapsed_before: float = 0.0
    start_time: float | None = None

    def start_clock(self) -> None:
        self.start_time = time.time()

    def elapsed(self) -> float:
        """Training seconds, resumed runs included."""
        return self.elapsed_before + (time.time() - self.start_time if self.start_time is not None else 0.0)

    def time_done(self, max_minutes: float) -> float:
        """The share of `max_minutes` spent so far (resumed runs included); 0 without a budget."""
        budget = 60.0 * max_minutes
        return min(1.0, self.elapsed() / budget) if budget > 0 else 0.0

    def add_eval(self, record: dict) -> bool:
        """Keep a validation's record; True when it is the best so far."""
        self.evals.append(record)
        if record["exprate"] > self.best.exprate:
            self.best = Best(record["exprate"], record["step"])
            return True
        return False

    def state_dict(self) -> dict:
        """The record's part of a checkpoint (keys as checkpoints have always had them)."""
        return {
            "step": self.step,
            "best": self.best._asdict(),
            "evals": list(self.evals),
            "anomalies": list(self.anomalies),
            "elapsed": self.elapsed(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.best = Best(**state["best"])
        self.evals = list(state["evals"])
        self.anomalies = list(state["anomalies"])
        self.elapsed_before = float(state.get("elapsed", 0.0))
