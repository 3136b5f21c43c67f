"""The checkpointer: one `state()` of the run (what checkpoints, snapshots and anomaly files hold), written atomically
under RUN_DIR/checkpoints and RUN_DIR/anomalies, and one way to load it back: `restore_training` for what resume,
a rollback and the benchmark's reset share, `load` for a resumed run's counters, stream position and RNG on top."""

import logging
import math
from pathlib import Path

import torch
from omegaconf import OmegaConf

from wapstable.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from wapstable.errors import UserError
from wapstable.stability.guard import grad_figures
from wapstable.stability.step_guard import StepResult
from wapstable.train.parts import RunParts
from wapstable.train.record import RunRecord

log = logging.getLogger("wapstable")


class Checkpointer:
    """Saves and loads the state of `parts` and `record` (it reads them; it calls nothing else)."""

    def __init__(self, parts: RunParts, record: RunRecord):
        self.parts, self.record = parts, record

    def state(self) -> dict:
        p = self.parts
        return {
            "model": p.model.state_dict(),
            "ema": p.ema.state_dict() if p.ema is not None else None,
            "optimizer": p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict(),
            "scaler": p.scaler.state_dict(),
            "stream": p.stream.state_dict(),
            "rng": rng_state(),
            "vocab": list(p.vocab.tokens),
            "config": OmegaConf.to_container(p.cfg, resolve=True, enum_to_str=True),
            "guard": {
                "budget": p.budget.state_dict(),
                "spikes": p.spikes.state_dict(),
                "clip": p.clip.state_dict(),
            },
            "rollback": p.rollback.state_dict(),
            "counters": p.guard.counters(),
            "ink_stats": p.ink_stats.as_dict() if p.ink_stats is not None else None,
            **self.record.state_dict(),
        }

    def restore_training(self, state: dict) -> None:
        """Model (and its average), optimizer, schedule, GradScaler and the clip rule's state (AutoClip's history)
        from a state: what resume, a rollback and the benchmark's reset have in common."""
        p = self.parts
        p.model.load_state_dict(state["model"])
        if p.ema is not None:
            p.ema.restore(state.get("ema"), p.model)
        p.optimizer.load_state_dict(state["optimizer"])
        p.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            p.scaler.load_state_dict(state["scaler"])
        guard = state["guard"]  # from before the clip rules: AutoClip's history under "history"
        p.clip.load_state_dict(guard["clip"] if "clip" in guard else {"history": guard.get("history")})
        p.guard.refresh()  # the buffers as loaded are the ones before the next forward

    def load(self, state: dict) -> None:
        """A resumed run: the training state, then the record, stream, guard counters, back-off and RNG."""
        p = self.parts
        self.restore_training(state)
        self.record.load_state_dict(state)
        p.stream.load_state_dict(state["stream"])
        p.budget.load_state_dict(state["guard"]["budget"])
        p.spikes.load_state_dict(state["guard"]["spikes"])
        if "rollback" in state:
            p.rollback.load_state_dict(state["rollback"])
        self.apply_backoff()
        p.guard.load_counters(state["counters"])
        set_rng_state(state["rng"])
        p.guard.refresh()  # and the RNG

    def apply_backoff(self) -> None:
        """Scale the schedule's base lrs by the rollback back-off in force, set the current lrs to match, and
        tighten the guard's clip threshold by the clip back-off."""
        p = self.parts
        p.scheduler.base_lrs = [lr * p.rollback.lr_scale for lr in p.base_lrs]
        # This step's lr from the new base lrs; the scheduler's next step() computes the same (the trainer reads the
        # lr from the optimizer, never the scheduler's private copy).
        factor = p.scheduler.lr_lambdas[0](p.scheduler.last_epoch)
        for group, base in zip(p.optimizer.param_groups, p.scheduler.base_lrs):
            group["lr"] = base * factor
        p.guard.set_clip(p.clip.backed_off(p.rollback.clip_scale))

    def trusted_on_disk(self, resume_path: Path | None) -> dict | None:
        """The resumed run's checkpoints/trusted.pt (rollback only): a trusted state older than the resumed one."""
        if not self.parts.rollback.enabled or resume_path is None:
            return None
        path = resume_path.parent / "trusted.pt"
        if not path.is_file():
            return None
        try:
            return load_checkpoint(path)
        except UserError as e:
            log.warning("rollback: ignoring %s (%s)", path, e)
            return None

    def save(self, name: str) -> Path | None:
        """checkpoints/NAME.pt (the main rank only); with last.pt, the newest trusted state goes to trusted.pt."""
        p = self.parts
        if not p.dist.is_main:
            return None
        if name == "last" and (trusted := p.rollback.to_write()) is not None:
            save_checkpoint(trusted, p.run_dir / "checkpoints" / "trusted.pt")  # apart from last.pt
        return save_checkpoint(self.state(), p.run_dir / "checkpoints" / f"{name}.pt")

    def record_ink_stats(self, names=("best", "last")) -> None:
        """Write the run's ink statistics into its checkpoints `names` as they are on disk (the main rank only)."""
        p = self.parts
        if not p.dist.is_main:
            return
        for name in names:
            path = p.run_dir / "checkpoints" / f"{name}.pt"
            if path.is_file():
                state = load_checkpoint(path)
                state["ink_stats"] = p.ink_stats.as_dict() if p.ink_stats is not None else None
                save_checkpoint(state, path)

    def write_anomaly(
        self, result: StepResult, batch, rng_before: dict, stream_before: dict | None = None
    ) -> Path | None:
        """anomalies/step-N.pt: the state before the step (`stream_before`: the stream's position before the step's
        batch), its RNG, the offending batch and per-layer figures."""
        p, step = self.parts, self.record.step
        per_layer_norm, per_layer_bad = grad_figures(p.model)
        record = {"step": step, "reason": result.reason, "loss": result.loss, "grad_norm": result.grad_norm}
        dist = p.dist
        if dist.enabled:  # collectives: every rank gets here, since all ranks skip together
            # This rank's own view: DDP averaged the gradients, so after backward a NaN is on every rank.
            seen = not math.isfinite(result.loss) or dist.local_grads_nonfinite
            record["ranks"] = dist.ranks_with(seen)
            src = record["ranks"][0] if record["ranks"] else 0
            if src != 0:  # rank 0 writes the checkpoint: it takes the batch and loss of the rank that saw it
                mine = (batch.to(torch.device("cpu")), result.loss, result.reason)
                theirs = dist.from_rank(src, mine if dist.rank == src else None)
                batch, record["loss"], record["reason"] = theirs
            record["batch_rank"] = src  # replay applies that rank's share of the fault
        # On every rank, as the guard's count of anomaly checkpoints: the next skip's collectives depend on it.
        self.record.anomalies.append(record)
        if not dist.is_main:
            return None
        state = self.state()
        # Before the step: the stream had not yet handed out this batch, and the RNG was as saved before forward.
        state["stream"] = stream_before if stream_before is not None else p.stream.state_dict()
        state["rng"] = rng_before
        state["anomaly"] = {
            **record,
            "batch": {
                "images": batch.images.cpu(),
                "image_mask": batch.image_mask.cpu(),
                "targets": batch.targets.cpu(),
                "target_mask": batch.target_mask.cpu(),
                "ids": list(batch.ids),
                "regions": batch.regions.cpu() if getattr(batch, "regions", None) is not None else None,
            },
            "grad_norms": per_layer_norm,
            "nonfinite_counts": per_layer_bad,
        }
        path = save_checkpoint(state, p.run_dir / "anomalies" / f"step-{step}.pt")
        log.warning("step %d: anomaly checkpoint written to %s", step, path)
        return path
