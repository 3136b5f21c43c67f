"""Check the trainer's CUDA paths on one GPU in a few minutes: prints one table, exits 1 if any check failed.

    python scripts/gpu_check.py                      # on cuda (the default): the config's sizes, at most 5 minutes
    python scripts/gpu_check.py --quick              # debug=tiny model and data: seconds
    python scripts/gpu_check.py --device cpu --quick # the same checks on the CPU (the tests run this)
    make gpu-check ARGS="--quick"                    # the same through make; wapstable-gpu-check when installed

Every check builds the real `Trainer` in this process, on the device, and takes real guarded steps:

1. `nan skip`, for each model (the config's default and `model=densewap`) in each `trainer.precision` (32, bf16,
   fp16): a few normal steps, then a step with `fault=nan_input`. It must be skipped as non-finite and leave the
   parameters, the BatchNorm buffers, the optimizer state, the lr schedule and the grad-norm history bit-identical
   (compared as raw bits), the gradients cleared, and under fp16 the GradScaler's scale multiplied by its back-off
   factor (growth tracker reset); the step after it must be taken and change the weights.
2. `fp16 overflow` (fp16 only): a step whose scaled gradients overflow (the scale forced to 2^40) must be the
   GradScaler's own skip (not counted against the skip budget), bit-exact as above, with the scale backed off.
3. `host syncs`: host synchronisations per guarded normal step, counted with `torch.cuda.set_sync_debug_mode`
   (on the CPU: calls that copy a tensor's value to the host, the way `tests/test_step_guard.py` counts them).
   Target: exactly one, fp16 included: the guard already read that every gradient is finite, so it steps the
   optimizer itself instead of through `GradScaler.step` (whose own found-inf read would be a second sync). Fewer
   than one fails too: the guard's own read is a sync, so a counter that misses it is not counting.
4. `ddp`: one process, world size 1, NCCL (gloo on the CPU) set up by the trainer's own `distributed.setup` from
   torchrun's variables, the model in DistributedDataParallel with the trainer's comm hook, and the collectives
   turned on (`Dist.enabled` is false for one process, which would leave NCCL unused): the weight-checksum
   all-gather, guarded steps through DDP, a NaN step skipped on every rank with this rank named in its anomaly
   checkpoint, and the weights bit-identical after the skip.
5. `samples/s`: the default model's training steps per second on the device against the CPU, on the same
   batches: a figure, not a pass/fail test.

Without CUDA, `--device cuda` (the default) stops with one sentence and exit status 2.
"""

import argparse
import contextlib
import copy
import gc
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from wapstable.checkpoint import rng_state, set_rng_state
from wapstable.cli import run_script
from wapstable.config import CONF_DIR, TINY_OVERRIDES, quote_group_options, register_configs
from wapstable.errors import UserError
from wapstable.stability.step_guard import Outcome, StepResult
from wapstable.train.distributed import Dist
from wapstable.train.loop import Trainer

log = logging.getLogger("wapstable.gpu_check")

PRECISIONS = ("32", "bf16", "fp16")  # trainer.precision
MODELS = ("default", "densewap")  # default: the config's own model (conf/config.yaml)
FAULT_STEP = (
    1000  # the step index the NaN fault fires at; the checks set trainer.step to it for that one step
)
OVERFLOW_SCALE = 2.0**40  # a GradScaler scale at which any fp16 gradient overflows
TIME_LIMIT_S = 300.0
# Every check's trainer: no statistics (their rows are not what is checked, and they would add syncs on their own
# steps), batches in shuffled order rather than the first epoch's shortest labels first.
COMMON = ["trainer.progress=false", "stats.every=0", "data.curriculum_epochs=0"]
# The full check keeps the config's model, image and batch sizes but renders only a few hundred images.
FULL_DATA = ["data.num_train=256", "data.num_valid=8", "data.num_test=8"]
# --quick: debug=tiny, and a DenseNet watcher of the same shape but 2 layers per block.
QUICK_DENSE = ["model.watcher.init_channels=8", "model.watcher.growth=8", "model.watcher.layers=2"]
SIZES = {  # normal steps before the fault, counted steps for the syncs, timed steps on the device and the CPU
    "quick": dict(normal=2, sync_steps=3, warmup=1, timed=3, cpu_timed=3),
    "full": dict(normal=3, sync_steps=5, warmup=2, timed=20, cpu_timed=4),
}
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
COLUMNS = ("check", "model", "precision", "result", "figure", "detail")


@dataclass
class Row:
    check: str
    model: str
    precision: str
    result: str
    figure: str = ""
    detail: str = ""


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
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    if a.is_floating_point() and a.element_size() in _BITS:
        a, b = a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()])
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
    t.step += 1
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
    t.step = FAULT_STEP
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if _is_sync(w)]
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


def _is_sync(w: warnings.WarningMessage) -> bool:
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


class _OneRank(Dist):
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
            one = _OneRank(t.dist.rank, t.dist.world_size, t.dist.device)
            t.dist, t.ddp_model = one, one.wrap(t.model)
            t.guard.reduce_flag, t.guard.agree = one.any, one.agree
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
def run_check(rows: list[Row], check: str, model: str, precision: str, fn) -> bool:
    """Run one check into a row of the table; False when it failed."""
    log.info("checking: %s, %s, %s", check, model, precision)
    try:
        figure, detail = fn()
        row = Row(check, model, precision, PASS, figure, detail)
    except Skipped as e:
        row = Row(check, model, precision, SKIP, e.figure, e.detail)
    except CheckFailed as e:
        row = Row(check, model, precision, FAIL, e.figure, e.detail)
    except Exception as e:  # a crash is a failed check; the traceback goes to stderr, the table goes on
        log.exception("%s %s %s crashed", check, model, precision)
        row = Row(check, model, precision, FAIL, "error", f"{type(e).__name__}: {e}".splitlines()[0])
    rows.append(row)
    return row.result != FAIL


def precision_skip(device: torch.device, precision: str) -> str | None:
    if device.type == "cuda" and precision == "bf16" and torch.cuda.get_device_capability(device)[0] < 8:
        return f"{torch.cuda.get_device_name(device)} has no bf16 (compute capability below 8.0)"
    return None


def check_model(ctx: Check, rows: list[Row], model: str) -> None:
    overrides = [] if model == "default" else [f"model={model}"]
    cfg = ctx.compose(overrides)
    if ctx.quick and cfg.model.watcher._target_.endswith(".DenseWatcher"):
        overrides += QUICK_DENSE
    label = f"{cfg.model.name} (default)" if model == "default" else cfg.model.name
    for precision in PRECISIONS:
        checks = ["nan skip", *(["fp16 overflow"] if precision == "fp16" else []), "host syncs"]
        reason = precision_skip(ctx.device, precision)
        if reason:
            rows.extend(Row(c, label, precision, SKIP, "", reason) for c in checks)
            continue
        box: list[Trainer] = []

        def build(precision=precision, box=box):
            box.append(
                ctx.trainer(
                    [
                        *overrides,
                        f"trainer.precision={precision}",
                        "fault=nan_input",
                        f"fault.step={FAULT_STEP}",
                    ]
                )
            )
            return check_nan_skip(ctx, box[0])

        run_check(rows, "nan skip", label, precision, build)
        if not box:
            rows.extend(
                Row(c, label, precision, FAIL, "", "not run: the trainer was not built") for c in checks[1:]
            )
            continue
        t = box[0]
        if precision == "fp16":
            run_check(rows, "fp16 overflow", label, precision, lambda t=t: check_fp16_overflow(ctx, t))
        run_check(rows, "host syncs", label, precision, lambda t=t: check_syncs(ctx, t))
        box.clear()
        del t
        release(ctx)


def release(ctx: Check) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def table(rows: list[Row]) -> str:
    cells = [COLUMNS, *(astuple(r) for r in rows)]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(COLUMNS) - 1)]

    def line(c) -> str:
        return "| " + " | ".join([*(str(x).ljust(w) for x, w in zip(c, widths)), str(c[-1])]) + " |"

    return "\n".join(
        [line(COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|---|"]
        + [line(c) for c in cells[1:]]
    )


def summary(rows: list[Row], seconds: float) -> str:
    n = Counter(r.result for r in rows)
    verdict = f"FAILED: {n[FAIL]} check{'s' * (n[FAIL] > 1)}" if n[FAIL] else "all checks passed"
    return f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped in {seconds:.0f} s: {verdict}"


def resolve(name: str) -> torch.device:
    """`--device`: cpu, cuda or cuda:N; a UserError, before anything is built, when CUDA is not there."""
    if name != "cpu" and name != "cuda" and not name.startswith("cuda:"):
        raise UserError(f"--device {name} is unknown; use cuda (the default), cuda:N or cpu")
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        why = (
            "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        )
        raise UserError(
            f"the GPU check needs a CUDA GPU and {why} (torch {torch.__version__}); run it on a machine with one, "
            "or add --device cpu to run the same checks on the CPU"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def machine(device: torch.device) -> str:
    where = str(device)
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda})"
    return f"torch {torch.__version__} on {where}, CPU threads: {torch.get_num_threads()}"


@contextlib.contextmanager
def time_limit(seconds: float, rows: list[Row], t0: float, tmp: Path):
    """Past `seconds`, print the table of what finished with a FAIL row, remove `tmp` and exit 1 (a hung
    collective or kernel cannot be interrupted from Python)."""
    if seconds <= 0:
        yield
        return

    def expire():
        late = Row(
            "time limit", "-", "-", FAIL, f"{seconds:g} s", "the check ran past --time-limit and was stopped"
        )
        print(table([*rows, late]) + "\n\n" + summary([*rows, late], time.perf_counter() - t0), flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def restored_process_state():
    """The trainers set torch's threads and seeds and the checks quiet the trainer's log: undone at the end, so a
    caller in the same process (the tests) finds them as they were."""
    threads, rng = torch.get_num_threads(), rng_state()
    logger = logging.getLogger("wapstable")
    level = logger.level
    try:
        yield
    finally:
        logger.setLevel(level)
        torch.set_num_threads(threads)
        set_rng_state(rng)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", default="cuda", help="cuda (default), cuda:N, or cpu to run the checks on the CPU"
    )
    p.add_argument("--quick", action="store_true", help="debug=tiny model and data: seconds")
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma-separated model configs (conf/model/), default = the config's own (default: default,densewap)",
    )
    p.add_argument(
        "--time-limit", type=float, default=TIME_LIMIT_S, help="seconds before the check gives up (0: none)"
    )
    p.add_argument("--cache-dir", help="synthetic data cache (default: the config's data.cache_dir)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every trainer, e.g. optim=adadelta")
    args = p.parse_args(argv)
    device = resolve(args.device)  # no CUDA: one sentence and exit 2, before anything is built
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    known = {f.stem for f in (CONF_DIR / "model").glob("*.yaml")}
    unknown = [m for m in models if m != "default" and m not in known]
    if unknown or not models:
        raise UserError(f"--models {args.models}: use default or any of {', '.join(sorted(known))}")

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    rows: list[Row] = []
    base = [*(TINY_OVERRIDES if args.quick else FULL_DATA), *COMMON, *args.overrides]
    if args.cache_dir:
        base.append(f"data.cache_dir={args.cache_dir}")
    register_configs()
    with (
        tempfile.TemporaryDirectory(prefix="wapstable-gpu-check-") as tmp,
        restored_process_state(),
        time_limit(args.time_limit, rows, t0, Path(tmp)),
    ):
        logging.getLogger("wapstable").setLevel(logging.ERROR)  # the skips here are on purpose
        log.setLevel(logging.INFO)
        ctx = Check(device, base, SIZES["quick" if args.quick else "full"], Path(tmp), args.quick)
        for model in models:
            check_model(ctx, rows, model)
        default = f"{ctx.compose([]).model.name} (default)"
        for backend in ("nccl", *(() if ctx.cuda else ("gloo",))):
            run_check(rows, f"ddp {backend}", default, "32", lambda b=backend: check_ddp(ctx, b))
            release(ctx)
        run_check(rows, "samples/s", default, "32", lambda: check_samples_per_s(ctx))
        header = f"wapstable gpu-check ({'quick' if args.quick else 'full'}): {machine(device)}"
    print(f"{header}\n\n{table(rows)}\n\n{summary(rows, time.perf_counter() - t0)}", flush=True)
    return 1 if any(r.result == FAIL for r in rows) else 0


def run() -> None:
    """The console entry point `wapstable-gpu-check`."""
    run_script(main)


if __name__ == "__main__":
    run()
