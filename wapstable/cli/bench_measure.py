"""The measuring parts of `scripts/bench.py` (wapstable/cli/bench.py says what it measures): medians with their
spread, interleaved blocks, ratios, the device's clock, and one trainer per variant started from the same state."""

import contextlib
import copy
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from wapstable.config import CONF_DIR, quote_group_options
from wapstable.device import cuda_sync_warnings
from wapstable.model.loss import forward_loss
from wapstable.stability.clip import plan_clip
from wapstable.train.loop import Trainer

log = logging.getLogger("wapstable.bench")

# Variants of the training step, as config overrides on top of the base config (the command line's).
# "guards off" turns off every guard the config can turn off; what the trainer does regardless (the total norm,
# the finite flag and its one host sync, the BatchNorm buffer copy) is part of that baseline, and "bare" (a loop
# with none of it) shows what it costs.
STEP_MODES = {
    "off": ["guard.skip_nonfinite=false", "clip=none", "stats.every=0"],
    "guard": ["stats.every=0"],  # the default guard and the config's clipping
    "stats/step": ["stats.every=1"],  # guard + statistics on every step; the default interval is derived
    "anomaly": ["stats.every=0", "guard.detect_anomaly=true"],  # guard + torch.autograd.detect_anomaly
}


# ---- measurement ----
def summary(xs: list[float]) -> dict:
    """Median with quartiles and range: the spread says how far a ratio can be trusted."""
    q = np.percentile(xs, [0, 25, 50, 75, 100]).tolist()
    return {"median": q[2], "q1": q[1], "q3": q[3], "min": q[0], "max": q[4], "n": len(xs)}


def interleave(
    blocks: dict[str, Callable[[], float]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run each block once per repeat, the order rotated per repeat; the warm-up repeats are discarded.

    A block returns its own measured seconds (its set-up is not timed). Interleaving spreads a busy machine's
    slow spells over every variant instead of charging them to whichever ran then.
    """
    names = list(blocks)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            t = blocks[name]()
            if r >= warmup:
                times[name].append(t)
    return times


def ratios(times: dict[str, list[float]], base: str) -> dict[str, dict]:
    """Per variant: time summary and the ratio to `base` within each repeat (paired, so drift cancels)."""
    out = {}
    for name, ts in times.items():
        paired = [t / b for t, b in zip(ts, times[base])]
        out[name] = {"seconds": summary(ts), "ratio": summary(paired)}
    return out


class Device:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], None]) -> float:
        """Seconds of `fn`, with the device's queued work finished on both sides."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


@contextlib.contextmanager
def count_syncs(counter: list[int]):
    """Counts CUDA host synchronisations through sync debug mode's warnings (CUDA only)."""
    with cuda_sync_warnings() as caught:
        yield
    counter.append(sum("synchroniz" in str(w.message) for w in caught))


# ---- config and trainers ----
def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=quote_group_options(list(overrides)))


class StepBench:
    """Trainers for every step variant, on the same batches and the same starting weights."""

    def __init__(self, base: list[str], steps: int, tmp: Path, dev: Device | None = None):
        self.base, self.tmp = base, tmp
        self.trainers: dict[str, Trainer] = {}
        self.reference = self.trainer("guard", STEP_MODES["guard"])
        self.dev = dev or Device(self.reference.device)
        self.cfg = self.reference.cfg
        stream = self.reference.stream
        # The same batches for every variant and every block: equal work, so only the variant differs.
        self.batches = [stream.next().to(self.dev.device) for _ in range(steps)]
        for batch in self.batches[: max(2, steps)]:  # a few real steps, so the optimizer has state to restore
            self.reference.train_step(batch)
        ref = self.reference
        self.snapshot = copy.deepcopy(
            {
                "model": ref.model.state_dict(),
                "optimizer": ref.optimizer.state_dict(),
                "scheduler": ref.scheduler.state_dict(),
                "guard": {"clip": {}},  # each trainer's rule starts empty (reset)
            }
        )

    def trainer(self, name: str, overrides: list[str]) -> Trainer:
        if name not in self.trainers:
            cfg = compose([*self.base, *overrides])
            cfg.run_dir = str(self.tmp / name.replace("/", "-"))
            self.trainers[name] = Trainer(cfg)
        return self.trainers[name]

    def reset(self, t: Trainer) -> None:
        """Every block starts from the same weights, optimizer state, schedule and empty autoclip history."""
        t.restart(self.snapshot)

    def run_steps(self, t: Trainer) -> None:
        with warnings.catch_warnings():
            # detect_anomaly's "will increase the runtime" on every entry; only it, so sync warnings still count
            warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
            anomaly = torch.autograd.detect_anomaly() if t.cfg.guard.detect_anomaly else None
            with anomaly or contextlib.nullcontext():
                for batch in self.batches:
                    t.train_step(batch)
                    t.go_to_step(t.step + 1)

    def block(self, t: Trainer, steps: Callable[[Trainer], None] | None = None) -> Callable[[], float]:
        """A timed block of `steps` (default: `t`'s own training steps), from the same starting state each time."""
        steps = steps or self.run_steps

        def run() -> float:
            self.reset(t)
            return self.dev.timed(lambda: steps(t))

        return run

    def plain_steps(self, t: Trainer, clip: bool = False) -> None:
        """`t`'s model and optimizer in a plain loop: what a user writes without the guard. `clip=False` is the bare
        loop (no norm, no flag, no sync, no copies); `clip=True` adds `t`'s clipping, as the guard would clip."""
        for batch in self.batches:
            t.optimizer.zero_grad(set_to_none=True)
            forward_loss(t.model, batch, None, 0, t.cfg.trainer.precision).backward()
            if clip:
                plan_clip(t.model.parameters(), t.clip)[1].apply()
            t.optimizer.step()
            t.scheduler.step()

    def syncs_per_step(self, t: Trainer, bare: bool = False) -> float:
        """Host syncs per training step of `t` (CUDA only: on the CPU there is no device to wait for)."""
        self.reset(t)
        self.dev.sync()
        counter: list[int] = []
        with count_syncs(counter):  # no explicit synchronize inside: only the steps' own syncs count
            (self.plain_steps if bare else self.run_steps)(t)
        self.dev.sync()
        return counter[0] / len(self.batches)


# ---- sections ----
