"""One training process per run directory: an exclusive lock on `RUN_DIR/run.lock`, refused with one sentence.

Two processes on one run directory (a requeued job starting while the old one still flushes, `resume=auto`
started twice) would interleave checkpoint writes. The holder writes its PID into the lock file; a second process
is refused with the directory and that PID, before anything is written (Hydra's `on_run_start` callback takes the
lock for a plain run, before Hydra writes `.hydra/` and `train.log`; `train()` takes it for every run, sweep jobs
included). Under torchrun only rank 0 holds it.

The lock is a POSIX record lock (`fcntl.lockf`): the OS releases it when the process dies, however it dies, so a
killed run never leaves a stale lock; unlike `flock`, it is not shared with forked children (data-loading and
rendering workers), so a killed trainer's directory can be resumed at once even while its workers wind down.
The PID left in the file by a dead holder means nothing: only the lock counts.
"""

import contextlib
import fcntl
import os
from pathlib import Path

from wapstable.errors import UserError

LOCK_NAME = "run.lock"
_held: dict[
    Path, int
] = {}  # run directory -> the open lock file: closing any descriptor of it drops the lock


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def acquire(run_dir: str | Path) -> None:
    run_dir = Path(run_dir).resolve()
    if run_dir in _held or not is_rank_zero():
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(
            f"cannot create {run_dir / LOCK_NAME} ({e.strerror}); choose a writable hydra.run.dir"
        ) from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)  # this process holds no lock on it, so closing drops nothing
        holder = (run_dir / LOCK_NAME).read_text().strip() or "unknown"
        raise UserError(
            f"{run_dir} is in use by another training process (PID {holder}); wait for it to end or stop it, "
            "or start this run in another hydra.run.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[run_dir] = fd


def release(run_dir: str | Path) -> None:
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def run_lock(run_dir: str | Path):
    """Hold the run directory's lock for the length of the block (a no-op when this process holds it)."""
    held_before = Path(run_dir).resolve() in _held
    acquire(run_dir)
    try:
        yield
    finally:
        if not held_before:
            release(run_dir)
