"""How many intra-op threads torch uses in a run: `trainer.threads`.

torch takes every core by default, and processes that do so on the same cores (trials of a joblib sweep, the ranks
of torchrun on a CPU) spend their time waiting for each other: two 150-step runs started together on 2 cores took
338 s each, against 20 s alone, and 28 s each with one thread apiece. `auto` gives each process its share of the
cores it may run on: the cores divided by the processes sharing them (torchrun's local world size times the
sweep's parallel jobs), at least 1.
"""

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from wapstable.errors import UserError

log = logging.getLogger(__name__)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a SLURM allocation or `taskset`, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def parallel_jobs(launcher: Mapping, sweeper: Mapping) -> int:
    """How many jobs of a sweep run at once on this machine, from Hydra's launcher and sweeper config: the joblib
    launcher's n_jobs (negative: counted back from the cores, as joblib does), no more than the sweeper launches in
    one batch; 1 for every other launcher (basic: one job at a time; SLURM: a job has its own cores)."""
    if not str(launcher.get("_target_", "")).endswith("JoblibLauncher"):
        return 1
    n_jobs = int(launcher.get("n_jobs") or 1)
    if n_jobs < 0:
        n_jobs = available_cores() + 1 + n_jobs
    batch = sweeper.get("n_jobs", sweeper.get("max_batch_size"))  # the Optuna sweeper's batch, or basic's
    return max(1, min(n_jobs, batch) if batch else n_jobs)


def resolve_threads(setting: int | str, parallel: int = 1) -> int:
    """torch's intra-op thread count for `trainer.threads`: a number as given (0 = torch's default), or for `auto`
    the available cores divided by the processes sharing them (`parallel` jobs x LOCAL_WORLD_SIZE), at least 1.
    A UserError naming the key for anything else."""
    if setting == "auto":
        processes = max(1, parallel) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return max(1, available_cores() // processes)
    if isinstance(setting, str) and setting.isdigit():  # trainer.threads='4'
        setting = int(setting)
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        return setting
    raise UserError(
        f"trainer.threads={setting} is not a thread count; use auto (this process's share of the cores), "
        "a number >= 1, or 0 for torch's default"
    )


def registry_dir() -> Path:
    """Where this user's running trainers announce themselves (one small locked file each)."""
    return Path(
        os.environ.get("WAPSTABLE_TRAINERS_DIR") or Path(tempfile.gettempdir()) / f"wapstable-{os.getuid()}"
    )


class CoreShare:
    """`trainer.threads=auto` across independent trainers on one machine: two `train.py` in two terminals.

    Each trainer holds a locked file in `registry_dir()` naming the cores it may run on, and about once a second
    (at a step boundary) counts the live trainers whose cores overlap its own: with `n` of them it uses
    `cores // n` threads (never more than `resolve_threads` gives for its sweep or torchrun share; at least 1),
    and its full share again when the others end. A trainer that dies leaves its file unlocked, and the next count
    deletes it; the lock, not a PID, says who is alive.

    Why: OpenMP threads spin while they wait for each other. Two runs with 2 threads each on 2 cores took 173 s each
    instead of 29 s for one alone (120 steps), while one thread each keeps both near the lone run's time and a run
    alone keeps both threads (docs/scaling.md, "Two runs at once"; `scripts/share_cores.py` measures it).
    """

    def __init__(self, parallel: int = 1, interval_s: float = 1.0):
        self.floor = resolve_threads("auto", parallel)  # the sweep's and torchrun's share
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.interval_s, self.next_check = interval_s, 0.0
        self.path: Path | None = None
        self.fd: int | None = None

    def __enter__(self) -> "CoreShare":
        directory = registry_dir()
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = directory / f".{os.getpid()}.{time.monotonic_ns()}.tmp"
            self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(self.fd, json.dumps({"pid": os.getpid(), "cores": self.cores}).encode())
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path = tmp.with_name(f"{os.getpid()}.{time.monotonic_ns()}.trainer")
            os.replace(tmp, self.path)  # locked before it is visible: no live trainer is ever taken for dead
        except OSError as e:  # an unwritable temp dir: this run keeps its static share
            log.warning("trainer.threads=auto cannot register in %s (%s); not sharing cores", directory, e)
            self.close()
        self.update(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def others(self) -> int:
        """Live trainers of this user on cores that overlap this one's (files of dead ones are deleted)."""
        count = 0
        for path in registry_dir().glob("*.trainer"):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # gone since the glob
                continue
            try:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:  # locked: its trainer is alive
                    info = json.loads(os.read(fd, 1 << 16) or b"{}")
                    cores = set(info.get("cores") or [])
                    count += not cores or not self.cores or bool(cores & set(self.cores))
                else:  # nobody holds it: a trainer that died without removing it
                    with contextlib.suppress(OSError):
                        path.unlink()
            except ValueError:  # a file being written by hand, or foreign: not a trainer
                pass
            finally:
                os.close(fd)
        return count

    def update(self, force: bool = False) -> int:
        """Re-count the trainers (at most once per interval unless `force`) and set torch's threads; returns them."""
        now = time.monotonic()
        if self.path is not None and (force or now >= self.next_check):
            self.next_check = now + self.interval_s
            others = self.others()
            threads = max(1, min(self.floor, available_cores() // (1 + others)))
            if threads != torch.get_num_threads():
                log.info(
                    "trainer.threads=auto: %d threads (%d other trainers on these cores)", threads, others
                )
                torch.set_num_threads(threads)
        return torch.get_num_threads()
