"""The run log: what a run says while it trains, to the configured loggers (`cfg.logger`: TensorBoard, CSV, MLflow,
W&B), to the progress bar and to train.log. The main rank writes; elsewhere every call is a no-op."""

import logging
import time
from pathlib import Path

from omegaconf import DictConfig

from wapstable.eval.attention_maps import attention_pictures
from wapstable.stability.step_guard import StepResult
from wapstable.train.loggers import Loggers, build_loggers

log = logging.getLogger("wapstable")


class RunLog:
    """The loggers (opened by `open`), the progress bar, and the lines of train.log."""

    def __init__(self, cfg: DictConfig, run_dir: Path, is_main: bool):
        self.cfg, self.run_dir, self.is_main = cfg, run_dir, is_main
        self.loggers: Loggers | None = None
        self.progress = None
        # the last training step's auxiliary losses, unweighted (the evaluation's line says them)
        self.last_guide: float | None = None
        self.last_symbols: float | None = None

    # ---- the loggers ----
    def open(self, config: dict, extra_scalars: list[str]) -> Loggers | None:
        if self.is_main and self.loggers is None:
            self.loggers = build_loggers(self.cfg.logger, self.run_dir, config, extra_scalars)
        return self.loggers

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.loggers is not None:
            self.loggers.scalar(tag, value, step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.loggers is not None:
            self.loggers.text(tag, text, step)

    def flush(self) -> None:
        if self.loggers is not None:
            self.loggers.flush()

    def close(self, finished: bool) -> None:
        """Close the loggers; a run that did not finish (stopped by the guard, crashed) is marked failed."""
        if self.loggers is not None:
            self.loggers.close(finished)
            self.loggers = None

    # ---- the progress bar and train.log ----
    def open_progress(self, step: int) -> None:
        t = self.cfg.trainer
        if not (t.progress and self.is_main):
            return
        from tqdm import tqdm

        # Under a time budget the step total is only a cap: say so, since the bar's ETA counts steps.
        desc = (
            f"train (ends at {t.max_minutes:g} min or step {t.max_steps})" if t.max_minutes > 0 else "train"
        )
        self.progress = tqdm(total=t.max_steps, initial=step, desc=desc, dynamic_ncols=True)

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def say(self, message: str) -> None:
        """A line of train.log, also written above the progress bar."""
        if self.progress is not None:
            self.progress.write(message)
        log.info(message)

    def step(
        self, out: StepResult, step: int, lr: float, guide: float | None, symbols: float | None, skipped: int
    ) -> None:
        """One step's scalars, progress and debug line; `lr` is the one the step used, `guide` and `symbols` its
        attention guide's and symbol map's unweighted losses (None when off), `skipped` the skips so far."""
        if self.is_main:
            self.scalar("train/loss", out.loss, step)
            self.scalar("train/grad_norm", out.grad_norm, step)
            self.scalar("train/lr", lr, step)
            self.scalar("train/clipped", float(out.clipped), step)
            self.scalar("train/skipped", float(out.skipped), step)
            if guide is not None:
                self.scalar("train/guide", guide, step)
            if symbols is not None:
                self.scalar("train/symbol_map", symbols, step)
        every = self.cfg.trainer.log_every
        if self.progress is not None:
            self.progress.update(1)
            if step % every == 0 or out.skipped:
                extra = {"guide": f"{guide:.3f}"} if guide is not None else {}
                if symbols is not None:
                    extra["symbols"] = f"{symbols:.3f}"
                self.progress.set_postfix(
                    loss=f"{out.loss:.3f}", **extra, gnorm=f"{out.grad_norm:.3g}", skipped=skipped
                )
        self.last_guide, self.last_symbols = guide, symbols
        if step % every == 0:
            log.debug(
                "step %d loss %.4f grad_norm %.4g lr %.3g%s%s",
                step,
                out.loss,
                out.grad_norm,
                lr,
                f" attention guide {guide:.4f}" if guide is not None else "",
                f" symbol map {symbols:.4f}" if symbols is not None else "",
            )

    def validation(self, record: dict) -> None:
        """A validation's line (with the last step's auxiliary losses) and scalars."""
        step = record["step"]
        message = (
            f"step {step}: valid ExpRate {record['exprate']:.2f}%  WER {record['wer']:.2f}%  "
            f"loss {record['loss']:.3f}"
        )
        train = []
        if self.last_guide is not None:
            train.append(f"attention guide {self.last_guide:.3f}")
        if self.last_symbols is not None:
            train.append(f"symbol map {self.last_symbols:.3f}")
        if train:
            message += f"  (train: {', '.join(train)})"
        self.say(message)
        for k in ("exprate", "wer", "loss"):
            self.scalar(f"valid/{k}", record[k], step)

    def attention(self, model, samples: list, vocab, max_len: int, step: int) -> float:
        """`samples` with their attention, to TensorBoard; returns the seconds it took (0 without TensorBoard)."""
        writer = self.loggers.tensorboard if self.loggers else None
        if writer is None or not samples:
            return 0.0
        t0 = time.perf_counter()
        try:
            for i, picture in enumerate(attention_pictures(model, samples, vocab, max_len)):
                writer.add_image(f"attention/{i}", picture, step, dataformats="HWC")
        except Exception as e:  # a picture that fails must not end the run
            log.warning("attention images at step %d failed: %s", step, e)
        return time.perf_counter() - t0
