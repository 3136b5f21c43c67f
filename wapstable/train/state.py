"""A run's training state: one `state()` written by checkpoints, snapshots and anomaly files, and one way to load
it back (`restore_training` for what resume, a rollback and the benchmark's reset share; `load_state` for a
resume's counters, stream position and RNG on top)."""

import logging
import time
from pathlib import Path
from typing import NamedTuple

from omegaconf import OmegaConf

from wapstable.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from wapstable.errors import UserError

log = logging.getLogger("wapstable")


class Best(NamedTuple):
    """The best validation ExpRate so far and the step it was reached at (-1 before the first evaluation)."""

    exprate: float = -1.0
    step: int = -1


class TrainingState:
    """The state methods of `Trainer` (mixed into it; they read the trainer's components)."""

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
            "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
            "guard": {
                "budget": self.budget.state_dict(),
                "spikes": self.spikes.state_dict(),
                "clip": self.clip.state_dict(),
            },
            "rollback": self.rollback.state_dict(),
            "best": self.best._asdict(),
            "counters": self.guard.counters(),
            "evals": list(self.evals),
            "anomalies": list(self.anomalies),
            "elapsed": self.elapsed(),
            "ink_stats": self.ink_stats.as_dict() if self.ink_stats is not None else None,
        }

    def restore_training(self, state: dict) -> None:
        """Model, optimizer, schedule, GradScaler and the clip rule's state (AutoClip's history) from a state: what resume, a rollback and
        the benchmark's reset have in common."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        guard = state["guard"]  # from before the clip rules: AutoClip's history under "history"
        self.clip.load_state_dict(guard["clip"] if "clip" in guard else {"history": guard.get("history")})
        self.guard.refresh()  # the buffers as loaded are the ones before the next forward

    def load_state(self, state: dict) -> None:
        """A resumed run: the training state, then the step, stream, guard counters, records, clock and RNG."""
        self.restore_training(state)
        self.step = int(state["step"])
        self.stream.load_state_dict(state["stream"])
        self.budget.load_state_dict(state["guard"]["budget"])
        self.spikes.load_state_dict(state["guard"]["spikes"])
        if "rollback" in state:
            self.rollback.load_state_dict(state["rollback"])
        self.apply_backoff()
        self.best = Best(**state["best"])
        self.guard.load_counters(state["counters"])
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

    def save(self, name: str) -> Path | None:
        """checkpoints/NAME.pt (the main rank only); with last.pt, the newest trusted state goes to trusted.pt."""
        if not self.dist.is_main:
            return None
        if name == "last" and (trusted := self.rollback.to_write()) is not None:
            save_checkpoint(trusted, self.run_dir / "checkpoints" / "trusted.pt")  # apart from last.pt
        return save_checkpoint(self.state(), self.run_dir / "checkpoints" / f"{name}.pt")

    # ---- the clock: training seconds, resumed runs included ----
    def elapsed(self) -> float:
        return self.elapsed_before + (time.time() - self.start_time if self.start_time is not None else 0.0)

    def time_done(self) -> float:
        """The share of trainer.max_minutes spent so far (resumed runs included); 0 without a budget."""
        budget = 60.0 * self.cfg.trainer.max_minutes
        return min(1.0, self.elapsed() / budget) if budget > 0 else 0.0

    def time_up(self) -> bool:
        """Whether the wall-clock budget is spent, the same answer on every rank."""
        return self.cfg.trainer.max_minutes > 0 and self.dist.agree(self.time_done() >= 1.0)
