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
import gc
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

from wapstable.checkpoint import rng_state, set_rng_state
from wapstable.cli import run_script
from wapstable.cli.gpu_checks import (
    FAULT_STEP,
    Check,
    CheckFailed,
    Skipped,
    check_ddp,
    check_fp16_overflow,
    check_nan_skip,
    check_samples_per_s,
    check_syncs,
)
from wapstable.config import CONF_DIR, TINY_OVERRIDES, register_configs
from wapstable.errors import UserError
from wapstable.train.loop import Trainer

log = logging.getLogger("wapstable.gpu_check")

PRECISIONS = ("32", "bf16", "fp16")  # trainer.precision
MODELS = ("default", "densewap")  # default: the config's own model (conf/config.yaml)
TIME_LIMIT_S = 300.0
# Every check's trainer: no statistics (their rows are not what is checked, and they would add syncs on their own
# steps), batches in shuffled order rather than the first epoch's shortest labels first.
COMMON = ["trainer.progress=false", "stats.every=0", "data.batch.curriculum_epochs=0"]
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
