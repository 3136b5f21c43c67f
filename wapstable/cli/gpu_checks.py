"""The checks of `scripts/gpu_check.py` (wapstable/cli/gpu_check.py says what each one shows): the trainer built
on a device, real guarded steps, and raw-bit comparisons of everything a skipped step must leave as it was."""

import contextlib
import copy
import logging
import math
import os
import socket
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from wapstable.config import CONF_DIR, quote_group_options
from wapstable.device import cuda_sync_warnings
from wapstable.stability.step_guard import Outcome, StepResult
from wapstable.train.distributed import Dist
from wapstable.train.loop import Trainer

log = logging.getLogger("wapstable.gpu_check")

FAULT_STEP = (
    1000  # the step index the NaN fault fires at; the checks set trainer.step to it for that one step
)
OVERFLOW_SCALE = 2.0**40  # a GradScaler scale at which any fp16 gradient overflows


class CheckFailed(Exception):
    """A check's condition did not hold: the message is the row's detail."""

    def __init__(self, detail: str, figure: str = ""):
        super().__init__(detail)
        self.detail, self.figure = detail, figure


class Skipped(Exception):
    """A check that cannot run here: the message says why (and a figure, where it measured one)."""

    def __init__(self, detail: str, figure: str = ""):
        super().__init__(detail)
        self.detail, self.figure = detail, figure


class Check:
    """What every check shares: the device, the base overrides, the sizes and a folder for the run directories."""

    def __init__(self, device: torch.device, base: list[str], size: dict, tmp: Path, quick: bool):
        self.device, self.base, self.size, self.tmp, self.quick = device, base, size, tmp, quick
        self.cuda = device.type == "cuda"
        self.built = 0

    def compose(self, overrides: list[str]):
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=quote_group_options([*self.base, *overrides]))

    def trainer(self, overrides: list[str], device: torch.device | None = None) -> Trainer:
        device = device or self.device
        cfg = self.compose([*overrides, f"trainer.device='{device}'"])  # quoted: cuda:N
        self.built += 1
        cfg.run_dir = str(self.tmp / f"run-{self.built}")
        return Trainer(cfg)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


# ---- bit-exact comparison ----
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def clone(x):
    """A deep copy of a state (tensors cloned on their device), to compare with later."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(clone(v) for v in x)
    return copy.deepcopy(x)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and raw bits (NaN equals the same NaN, -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() in BITS:
        a, b = a.view(BITS[a.element_size()]), b.view(BITS[b.element_size()])
    return torch.equal(a, b)


def first_difference(a, b, path: str = "") -> str | None:
    """The path of the first place where two states differ, or None when they are bit-identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
        return None if ok else path
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path} (keys)"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{path} (length)"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else path


def training_state(t: Trainer) -> dict:
    """What a skipped step must leave bit-identical: weights and BatchNorm buffers (the model's state_dict), the
    optimizer's state and lrs, the schedule, and the grad-norm history (autoclip)."""
    return clone(
        {
            "model": t.model.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "clip": t.clip.state_dict(),
        }
    )


def unchanged(t: Trainer, before: dict, what: str) -> str:
    """Raise CheckFailed naming the first thing `what` changed; otherwise say what was compared."""
    diff = first_difference(before, training_state(t))
    if diff:
        raise CheckFailed(f"{what} changed {diff}", "not bit-exact")
    grads = [n for n, p in t.model.named_parameters() if p.grad is not None]
    if grads:
        raise CheckFailed(f"{what} left gradients behind ({grads[0]} and {len(grads) - 1} more)")
    m = before["model"]
    params = sum(1 for _ in t.model.parameters())
    return (
        f"{params} parameters, {len(m) - params} buffers, "
        f"optimizer state of {len(before['optimizer']['state'])} parameters, schedule bit-identical"
    )


# ---- steps ----
def batch(t: Trainer):
    return t.stream.next().to(t.device)


def step(t: Trainer, b) -> StepResult:
    """One guarded step of `t` on batch `b`, as the trainer takes it (fault, forward, the guard)."""
    result = t.train_step(b)
    t.go_to_step(t.step + 1)
    return result


def normal_steps(t: Trainer, n: int) -> int:
    """Take guarded steps until `n` were accepted; fp16 may first lose a few to the GradScaler finding its scale.
    Returns how many the GradScaler skipped."""
    accepted = scaler = 0
    for _ in range(n + 8):
        r = step(t, batch(t))
        if r.outcome is Outcome.ACCEPTED:
            accepted += 1
        elif r.outcome is Outcome.SCALER:
            scaler += 1
        else:
            raise CheckFailed(f"normal step {t.step - 1} was skipped: {r.reason}")
        if accepted == n:
            return scaler
    raise CheckFailed(f"only {accepted} of {n + 8} normal steps were taken ({scaler} GradScaler skips)")


def next_step_taken(t: Trainer, before: dict) -> None:
    """After a skip, training goes on: the next step is taken and moves the weights."""
    for _ in range(3):  # fp16: a step may go to the GradScaler lowering its scale further
        r = step(t, batch(t))
        if r.outcome is Outcome.ACCEPTED:
            break
        if r.outcome is not Outcome.SCALER:
            raise CheckFailed(f"the step after the skip was skipped too: {r.reason}")
    else:
        raise CheckFailed("no step after the skip was taken (GradScaler skips)")
    if not first_difference(before["model"], clone(t.model.state_dict())):
        raise CheckFailed("the step after the skip left the weights as they were")


def nan_step(t: Trainer) -> StepResult:
    """A step with `fault=nan_input`: the trainer's fault fires at FAULT_STEP (a NaN pixel in the first image)."""
    b = batch(t)
    t.go_to_step(FAULT_STEP)
    return step(t, b)


# ---- checks ----
def check_nan_skip(ctx: Check, t: Trainer) -> tuple[str, str]:
    fp16 = t.cfg.trainer.precision == "fp16"
    scaler_skips = normal_steps(t, ctx.size["normal"])
    before, scaler_before = training_state(t), t.scaler.state_dict()
    r = nan_step(t)
    if r.outcome is not Outcome.NONFINITE:
        raise CheckFailed(f"the NaN step's outcome is {r.outcome.value}, not a non-finite skip ({r.reason})")
    compared = unchanged(t, before, "the skipped step")
    detail = [r.reason, compared]
    if fp16:
        s, s0 = t.scaler.state_dict(), scaler_before
        want = s0["scale"] * s0["backoff_factor"]
        if s["scale"] != want or s["_growth_tracker"] != 0:
            raise CheckFailed(
                f"GradScaler scale {s0['scale']:g} -> {s['scale']:g} (growth tracker {s['_growth_tracker']}), "
                f"expected {want:g} and 0"
            )
        detail.append(f"GradScaler scale {s0['scale']:g} -> {s['scale']:g}")
        if scaler_skips:  # fp16 overflows of the first steps, while the GradScaler finds its scale
            detail.append(f"{scaler_skips} earlier step{'s' * (scaler_skips > 1)} skipped by the GradScaler")
    elif t.scaler.is_enabled():
        raise CheckFailed(f"a GradScaler is on under trainer.precision={t.cfg.trainer.precision}")
    next_step_taken(t, before)
    detail.append("the next step was taken")
    return "bit-exact", "; ".join(detail)


def check_fp16_overflow(ctx: Check, t: Trainer) -> tuple[str, str]:
    """The GradScaler's own skip: scaled gradients that overflow fp16, while the loss is finite."""
    scale = t.scaler.get_scale()
    before = training_state(t)
    skips, budget = t.guard.scaler_skips, t.budget.state_dict()
    t.scaler.update(new_scale=OVERFLOW_SCALE)
    try:
        r = step(t, batch(t))
        if r.outcome is not Outcome.SCALER:
            raise CheckFailed(
                f"a step at scale 2^40 gave {r.outcome.value}, not the GradScaler's skip ({r.reason})"
            )
        if r.counted or t.budget.state_dict() != budget or t.guard.scaler_skips != skips + 1:
            raise CheckFailed("the GradScaler's skip was counted against the skip budget")
        compared = unchanged(t, before, "the GradScaler's skip")
        now = t.scaler.get_scale()
        if now != OVERFLOW_SCALE * t.scaler.get_backoff_factor():
            raise CheckFailed(f"GradScaler scale 2^40 -> {now:g}, expected 2^39")
    finally:
        t.scaler.update(new_scale=float(scale))
    return "bit-exact", f"{r.reason}; {compared}; scale 2^40 -> 2^39; not counted against the budget"


class SyncCounter:
    """Host synchronisations while counting, and the code lines that made them.

    CUDA: `torch.cuda.set_sync_debug_mode("warn")` makes every synchronising call warn; the warnings are counted.
    CPU: there is no device to wait for, so every call that copies a tensor's value to the host (item, tolist,
    bool, float, int, index, numpy) is counted instead, as `tests/test_step_guard.py` does; torch.optim's own
    reads of its step counters (CPU tensors, also on CUDA) are left out. The CPU count cannot see a sync inside a
    torch op (a boolean mask, nonzero); CUDA's counter does.
    """

    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.total = 0
        self.where: Counter[str] = Counter()

    @contextlib.contextmanager
    def counting(self):
        """Count while the block runs."""
        with self._cuda_warnings() if self.cuda else self._tensor_reads():
            yield self

    @contextlib.contextmanager
    def _cuda_warnings(self):
        with cuda_sync_warnings() as caught:
            yield
        syncs = [w for w in caught if is_sync(w)]
        self.total = len(syncs)
        self.where.update(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)

    @contextlib.contextmanager
    def _tensor_reads(self):
        originals = {name: getattr(torch.Tensor, name) for name in self.READS}
        own = {
            name: torch.Tensor.__dict__.get(name) for name in self.READS
        }  # None: inherited from TensorBase
        optim = f"torch{os.sep}optim{os.sep}"

        def counting(name):
            original = originals[name]

            def read(tensor, *args, **kwargs):
                frame = sys._getframe(1)
                if optim not in frame.f_code.co_filename:
                    self.total += 1
                    self.where[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"] += 1
                return original(tensor, *args, **kwargs)

            return read

        try:
            for name in self.READS:
                setattr(torch.Tensor, name, counting(name))
            yield
        finally:
            for name, original in own.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)


def is_sync(w: warnings.WarningMessage) -> bool:
    return "synchroniz" in str(w.message)


def count_syncs(ctx: Check, t: Trainer, steps: int) -> tuple[SyncCounter, list[StepResult]]:
    """Host syncs over `steps` guarded normal steps of `t`, its batches already on the device."""
    batches = [batch(t) for _ in range(steps)]
    ctx.sync()
    with SyncCounter(ctx.cuda).counting() as counter:  # no explicit synchronize inside
        results = [step(t, b) for b in batches]
    ctx.sync()
    return counter, results


def check_syncs(ctx: Check, t: Trainer) -> tuple[str, str]:
    n = ctx.size["sync_steps"]
    counter, results = count_syncs(ctx, t, n)
    skipped = [r for r in results if r.skipped]
    if skipped:
        raise CheckFailed(f"{len(skipped)} of the {n} counted steps were skipped ({skipped[0].reason})")
    own = counter.total / n
    figure = f"{own:g}/step"
    how = "set_sync_debug_mode" if ctx.cuda else "CPU: host reads of tensors"
    detail = f"{how}, {n} steps"
    if own > 1:
        where = ", ".join(f"{k} x{v}" for k, v in counter.where.most_common(4))
        raise CheckFailed(f"more than one per step (target <= 1): {where}; {detail}", figure)
    # the guard reads loss, norm and flags once per step: that read is a sync the counter must see
    if own < 1:
        raise CheckFailed(
            f"fewer than the guard's own read per step: the counter is not counting; {detail}", figure
        )
    return figure, detail


class OneRank(Dist):
    """The trainer's Dist with its collectives on for a one-process group. `Dist.enabled` is `world_size > 1`, so
    one process would skip DDP and every collective, and the check would not touch NCCL."""

    @property
    def enabled(self) -> bool:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_ddp(ctx: Check, backend: str) -> tuple[str, str]:
    if backend == "nccl" and not ctx.cuda:
        raise Skipped("NCCL needs CUDA (--device cpu); the row below runs the same over gloo")
    if not dist.is_available() or (backend == "nccl" and not dist.is_nccl_available()):
        raise CheckFailed(f"this torch has no {backend} backend")
    if dist.is_initialized():
        raise CheckFailed("a process group exists already in this process")
    index = (
        ctx.device.index if ctx.device.index is not None else (torch.cuda.current_device() if ctx.cuda else 0)
    )
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": str(index),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    with environment(env):
        try:
            # The trainer's own setup: torchrun's variables, init_process_group (nccl with device_id on CUDA).
            t = ctx.trainer(
                ["trainer.ddp=true", "trainer.precision=32", "fault=nan_input", f"fault.step={FAULT_STEP}"]
            )
            if dist.get_backend() != backend:
                raise CheckFailed(f"the process group runs {dist.get_backend()}, not {backend}")
            one = OneRank(t.dist.rank, t.dist.world_size, t.dist.device)
            t.use_distributed(one)
            if not isinstance(t.ddp_model, torch.nn.parallel.DistributedDataParallel):
                raise CheckFailed("the model is not in DistributedDataParallel")
            one.check_consistency(t.model, t.step)  # all-gather of the weight checksums
            normal_steps(t, 2)
            if one.local_grads_nonfinite:
                raise CheckFailed("the comm hook saw non-finite gradients in a normal step")
            before = training_state(t)
            r = nan_step(t)
            if r.outcome is not Outcome.NONFINITE:
                raise CheckFailed(f"the NaN step's outcome under DDP is {r.outcome.value} ({r.reason})")
            if not one.local_grads_nonfinite:
                raise CheckFailed("DDP's comm hook did not see this rank's NaN gradients")
            compared = unchanged(t, before, "the skipped step under DDP")
            ranks = t.anomalies[-1].get("ranks") if t.anomalies else None
            if ranks != [0] or r.anomaly_path is None or not Path(r.anomaly_path).is_file():
                raise CheckFailed(
                    f"the anomaly checkpoint names ranks {ranks} (expected [0]) at {r.anomaly_path}"
                )
            next_step_taken(t, before)
            one.check_consistency(t.model, t.step)
            ctx.sync()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    device = f" on {t.device}" if ctx.cuda else ""
    return (
        f"{backend}, world 1",
        f"DDP{device}: checksums all-gathered, steps taken, NaN step skipped with rank 0 in its anomaly "
        f"checkpoint, {compared}",
    )


def samples_per_s(ctx: Check, t: Trainer, batches: list, timed: int) -> float:
    """Samples per second of `t`'s guarded steps over `timed` batches (moved to its device in the loop, as in
    fit), after the warm-up batches."""
    warmup = ctx.size["warmup"]
    for b in batches[:warmup]:
        step(t, b.to(t.device))
    timed_batches = batches[warmup : warmup + timed]
    sync = ctx.sync if t.device.type == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    skipped = 0
    for b in timed_batches:
        skipped += step(t, b.to(t.device)).skipped
    sync()
    seconds = time.perf_counter() - t0
    if skipped:
        raise CheckFailed(f"{skipped} of the timed steps on {t.device} were skipped")
    return sum(b.images.shape[0] for b in timed_batches) / seconds


def check_samples_per_s(ctx: Check) -> tuple[str, str]:
    """The default model at its default batch, fp32, on the device and the CPU, on batches of the same stream
    (the CPU times the first few of the device's)."""
    size = ctx.size
    cpu = ctx.trainer(["trainer.precision=32"], torch.device("cpu"))
    batches = [cpu.stream.next() for _ in range(size["warmup"] + max(size["timed"], size["cpu_timed"]))]
    mean_batch = sum(b.images.shape[0] for b in batches) / len(batches)
    cpu_rate = samples_per_s(ctx, cpu, batches, size["cpu_timed"])
    threads = torch.get_num_threads()
    del cpu
    if not ctx.cuda:
        raise Skipped(
            f"no GPU to compare with (--device cpu): the CPU alone, {size['cpu_timed']} steps, {threads} threads, "
            f"mean batch {mean_batch:.1f}",
            f"{cpu_rate:.1f}/s on the CPU",
        )
    t = ctx.trainer(["trainer.precision=32"])
    rate = samples_per_s(ctx, t, batches, size["timed"])
    return (
        f"{rate:.0f} vs {cpu_rate:.1f}/s = {rate / cpu_rate:.1f}x",
        f"samples/s on {ctx.device} over {size['timed']} steps against the CPU ({threads} threads) over the "
        f"first {size['cpu_timed']} of the same batches (mean batch {mean_batch:.1f}), fp32; a figure, not a test",
    )


# ---- running and reporting ----
