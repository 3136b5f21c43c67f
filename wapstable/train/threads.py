"""How many intra-op threads torch uses in a run: `trainer.threads`.

torch takes every core by default, and processes that do so on the same cores (trials of a joblib sweep, the ranks
of torchrun on a CPU) spend their time waiting for each other: two 150-step runs started together on 2 cores took
338 s each, against 20 s alone, and 28 s each with one thread apiece. `auto` gives each process its share of the
cores it may run on: the cores divided by the processes sharing them (torchrun's local world size times the
sweep's parallel jobs), at least 1.
"""

import os
from collections.abc import Mapping

from wapstable.errors import UserError


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
