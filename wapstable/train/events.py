"""What happens around the steps of a run: the events after a step (consistency check, evaluation and the sweep's
pruner, snapshot, checkpoint), anomaly files and their localisation, the loggers, the stop signals, and the final
summary in `metrics.json`."""

import json
import logging
import math
import os
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from wapstable.checkpoint import load_checkpoint, save_checkpoint
from wapstable.device import autocast
from wapstable.eval.attention_maps import attention_pictures
from wapstable.eval.evaluation import combine_sets, evaluate_samples, score_test_sets
from wapstable.model.loss import guide_weight, sequence_loss
from wapstable.stability.guard import grad_figures
from wapstable.stability.step_guard import StepResult
from wapstable.train.loggers import GUIDE_SCALARS, SYMBOL_MAP_SCALARS, build_loggers
from wapstable.train.signals import StopSignals
from wapstable.train.state import Best

log = logging.getLogger("wapstable")


class RunEvents:
    """The event methods of `Trainer` (mixed into it; they read the trainer's components)."""

    # ---- after each step ----
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

    def log_step(self, out: StepResult, progress, lr: float) -> None:
        """Log one step's scalars; `lr` is the learning rate the step used (read before its scheduler stepped)."""
        # the attention guide's unweighted loss of this step (part of out.loss), when the guide is on
        value = getattr(self.model, "guide_value", None)
        guide = float(value) if value is not None else None
        value = getattr(self.model, "symbol_map_value", None)  # the symbol map's, likewise
        symbols = float(value) if value is not None else None
        if self.dist.is_main:
            self.scalar("train/loss", out.loss, self.step)
            self.scalar("train/grad_norm", out.grad_norm, self.step)
            self.scalar("train/lr", lr, self.step)
            self.scalar("train/clipped", float(out.clipped), self.step)
            self.scalar("train/skipped", float(out.skipped), self.step)
            if guide is not None:
                self.scalar("train/guide", guide, self.step)
            if getattr(self.model, "guide", None):
                self.scalar("train/guide_weight", guide_weight(self.model.guide, self.step), self.step)
            if symbols is not None:
                self.scalar("train/symbol_map", symbols, self.step)
        if progress is not None:
            progress.update(1)
            if self.step % self.cfg.trainer.log_every == 0 or out.skipped:
                extra = {"guide": f"{guide:.3f}"} if guide is not None else {}
                if symbols is not None:
                    extra["symbols"] = f"{symbols:.3f}"
                progress.set_postfix(
                    loss=f"{out.loss:.3f}", **extra, gnorm=f"{out.grad_norm:.3g}", skipped=self.budget.total
                )
        self.last_guide = guide  # the evaluation's line in train.log says them
        self.last_symbols = symbols
        if self.step % self.cfg.trainer.log_every == 0:
            log.debug(
                "step %d loss %.4f grad_norm %.4g lr %.3g%s%s",
                self.step,
                out.loss,
                out.grad_norm,
                lr,
                f" attention guide {guide:.4f}" if guide is not None else "",
                f" symbol map {symbols:.4f}" if symbols is not None else "",
            )

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

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, split: str, beam_size: int | None = None, samples=None, scales=(1.0,)) -> dict:
        """Metrics (and teacher-forced loss) of a split (or of `samples` of it), read at `scales`, through the same
        code as scripts/evaluate.py."""
        cfg = self.cfg
        self.model.scale_energies(1.0)  # faults act on training steps only

        def loss_fn(model, batch):
            with autocast(self.device, cfg.trainer.precision):
                logits = model(batch.images, batch.image_mask, batch.targets, batch.target_mask)
            return sequence_loss(logits, batch.targets, batch.target_mask)

        return evaluate_samples(
            self.model,
            self.vocab,
            self.splits[split] if samples is None else samples,
            beam_size or cfg.decode.beam_size,
            cfg.decode.max_len,
            cfg.data.pixel_budget,
            cfg.data.max_batch,
            self.device,
            loss_fn=loss_fn,
            scales=tuple(scales),
            length_power=float(cfg.decode.length_power),
        )

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
        train = []  # the last training step's auxiliary losses, unweighted
        if getattr(self, "last_guide", None) is not None:
            train.append(f"attention guide {self.last_guide:.3f}")
        if getattr(self, "last_symbols", None) is not None:
            train.append(f"symbol map {self.last_symbols:.3f}")
        if train:
            message += f"  (train: {', '.join(train)})"
        if progress is not None:
            progress.write(message)
        log.info(message)
        for k in ("exprate", "wer", "loss"):
            self.scalar(f"valid/{k}", result[k], self.step)
        self.log_attention()
        if result["exprate"] > self.best.exprate:
            self.best = Best(result["exprate"], self.step)
            self.save("best")
        return record

    def log_attention(self) -> None:
        """The first `stats.attention_images` validation samples with their attention, to TensorBoard."""
        n, writer = self.cfg.stats.attention_images, self.loggers.tensorboard if self.loggers else None
        if writer is None or n <= 0:
            return
        t0 = time.perf_counter()
        try:
            chosen = list(self.splits["valid"][:n])
            for i, picture in enumerate(
                attention_pictures(self.model, chosen, self.vocab, self.cfg.decode.max_len)
            ):
                writer.add_image(f"attention/{i}", picture, self.step, dataformats="HWC")
        except Exception as e:  # a picture that fails must not end the run
            log.warning("attention images at step %d failed: %s", self.step, e)
        self.stats.seconds += time.perf_counter() - t0

    def ask_pruner(self, record: dict) -> bool:
        """Hand an evaluation to `on_eval` (a sweep's pruner, on the main rank); True on every rank if it says stop."""
        if self.on_eval is None:
            return False
        return self.dist.agree(self.dist.is_main and bool(self.on_eval(record)))

    # ---- anomalies ----
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
                mine = (batch.to(torch.device("cpu")), result.loss, result.reason)
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
                "regions": batch.regions.cpu() if getattr(batch, "regions", None) is not None else None,
            },
            "grad_norms": per_layer_norm,
            "nonfinite_counts": per_layer_bad,
        }
        path = save_checkpoint(state, self.run_dir / "anomalies" / f"step-{self.step}.pt")
        log.warning("step %d: anomaly checkpoint written to %s", self.step, path)
        return path

    def localize(self, path: Path) -> None:
        """Replay the first anomaly checkpoint at once and log the first module and op that went non-finite."""
        from wapstable.stability.replay import replay, summarize

        try:
            report = replay(load_checkpoint(path), self.device)
        except Exception as e:  # a failed diagnosis must not end the run it diagnoses
            log.warning("localisation of %s failed: %s", path, e)
            return
        self.localization = {"checkpoint": str(path), **report}
        log.warning("localisation: %s", summarize(report))

    # ---- loggers ----
    def open_loggers(self) -> None:
        """The loggers of `cfg.logger` (the main rank only); the gradient statistics log through them too."""
        if self.dist.is_main and self.loggers is None:
            config = OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
            extra = list(GUIDE_SCALARS) if getattr(self.model, "guide", None) else []
            if getattr(self.model, "symbol_head", None) is not None:
                extra += SYMBOL_MAP_SCALARS
            self.loggers = build_loggers(self.cfg.logger, self.run_dir, config, extra)
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

    # ---- the end of a run ----
    def stop_for(self, signals: StopSignals) -> dict:
        """SIGTERM or the preemption signal: last.pt now, then submitit's requeue (or the caller's exit code)."""
        self.save("last")
        log.warning("%s: checkpoint written at step %d; resume with resume=auto", signals.name, self.step)
        self.finish_logs()
        signals.hand_over()  # under submitit: requeue the job and exit
        return {"stopped_at": self.step, "preempted": True, "exit_code": signals.exit_code}

    def training_metrics(self) -> dict:
        """The figures of the training so far (validation, skips, anomalies), without a test evaluation."""
        final_valid = self.evals[-1] if self.evals else {}
        counters = self.guard.counters()
        return {
            "steps": self.step,
            "stopped_by_time": self.stopped_by_time,
            "wall_time_s": round(self.elapsed(), 2),
            "best_valid_exprate": self.best.exprate,
            "best_step": self.best.step,
            "final_valid_exprate": final_valid.get("exprate"),
            "final_valid_wer": final_valid.get("wer"),
            "skipped_steps": self.budget.total + counters["scaler_skips"],
            "skipped_nonfinite": self.budget.nonfinite,
            "skipped_spikes": self.budget.spikes,
            "scaler_skips": counters["scaler_skips"],
            "anomaly_checkpoints": counters["anomaly_checkpoints"],
            "anomalies": self.anomalies,
            "clip_fraction": counters["clipped"] / max(1, counters["accepted"]),
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
            self.best.exprate,
        )
        self.finish_logs()
        if self.dist.is_main:
            write_json(self.run_dir / "metrics.json", metrics)
        return metrics

    def final_metrics(self) -> dict:
        """The test evaluation of the best checkpoint (beam decode.final_beam_size), then metrics.json."""
        best_path = self.run_dir / "checkpoints" / "best.pt"
        if best_path.is_file():
            self.model.load_state_dict(load_checkpoint(best_path)["model"])
        beam = self.cfg.decode.final_beam_size
        sets = score_test_sets(
            lambda samples: self.evaluate(
                "test", beam_size=beam, samples=samples, scales=self.cfg.decode.scales
            ),
            self.splits["test"],
            self.splits.report["test_sets"],
        )
        test = combine_sets(sets) if len(sets) > 1 else next(iter(sets.values()))
        metrics = {
            **self.training_metrics(),
            "test_exprate": test["exprate"],
            "test_wer": test["wer"],
            "test_within_1": test["within_1"],
            "test_scales": [float(v) for v in self.cfg.decode.scales],
            "test_length_power": float(self.cfg.decode.length_power),
            "test_sets": {
                name: {
                    k: r[k] for k in ("total", "read", "exprate", "within_1", "within_2", "within_3", "wer")
                }
                for name, r in sets.items()
            },
        }
        for name, r in sets.items():
            log.info(
                "test set %s: ExpRate %.2f%% of %d expressions (%d read), <=1 %.2f%%, <=2 %.2f%%, <=3 %.2f%%, WER %.2f%%",
                name,
                r["exprate"],
                r["total"],
                r["read"],
                r["within_1"],
                r["within_2"],
                r["within_3"],
                r["wer"],
            )
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
