"""trainer.threads=auto: each process gets its share of the cores it may run on, and the run's log says how many."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, compose_config

from wapstable.errors import UserError
from wapstable.train.threads import CoreShare, parallel_jobs, resolve_threads


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may run on `n` cores (its affinity mask), outside torchrun."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))

    return set_cores


def test_auto_divides_the_available_cores_among_the_processes(cores, monkeypatch):
    cores(8)
    assert resolve_threads("auto") == 8
    assert resolve_threads("auto", parallel=2) == 4  # two joblib trials at once
    assert resolve_threads("auto", parallel=3) == 2  # rounded down: 3 x 2 threads on 8 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node=4
    assert resolve_threads("auto") == 2
    assert resolve_threads("auto", parallel=16) == 1  # never fewer than one
    cores(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_threads("auto") == 1


def test_numbers_stay_as_given(cores):
    cores(2)
    assert resolve_threads(4) == 4  # more than the cores: the user's call
    assert resolve_threads("4") == 4  # trainer.threads='4'
    assert resolve_threads(0) == 0  # torch's default
    assert resolve_threads(1, parallel=8) == 1


@pytest.mark.parametrize("bad", [-3, "many", "-1", True, 1.5])
def test_bad_values_are_one_sentence_naming_the_key(bad):
    with pytest.raises(UserError, match=r"^trainer\.threads=.* is not a thread count; use auto"):
        resolve_threads(bad)


def test_parallel_jobs_of_a_joblib_sweep(cores):
    cores(8)
    joblib = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 4}
    assert parallel_jobs(joblib, {"max_batch_size": None}) == 4
    assert parallel_jobs(joblib, {"n_jobs": 2}) == 2  # the Optuna sweeper launches 2 trials per batch
    assert parallel_jobs({**joblib, "n_jobs": -1}, {}) == 8  # joblib's -1: every core
    assert parallel_jobs({**joblib, "n_jobs": -2}, {}) == 7
    basic = {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
    assert parallel_jobs(basic, {"max_batch_size": None}) == 1


def unlike_this_machine() -> int:
    """A core count that is neither this machine's (its affinity or all of its cores) nor TINY's one thread: a
    run that ignored the pretended cores could not show it by chance."""
    real = {os.cpu_count(), len(os.sched_getaffinity(0))}
    return next(n for n in (3, 5, 7) if n not in real)


def train_on_cores(tmp_path, cache_dir, cores, monkeypatch, caplog) -> str:
    """A tiny training with trainer.threads=auto, in this process, on `cores` pretended cores; returns its log."""
    from wapstable.train.stages import train

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    cfg = compose_config([*TINY, "trainer.threads=auto", "logger=csv"], run_dir=tmp_path / "run")
    cfg.data.cache_dir = str(cache_dir)
    before = torch.get_num_threads()
    try:
        with caplog.at_level("INFO", logger="wapstable"):
            train(cfg)
    finally:
        torch.set_num_threads(before)
    return caplog.text


def test_a_run_logs_its_thread_count(tmp_path, cache_dir, monkeypatch, caplog):
    cores = unlike_this_machine()
    log = train_on_cores(tmp_path, cache_dir, cores, monkeypatch, caplog)
    assert f"; device cpu; precision 32; {cores} threads" in log


HOLD = """
import sys, time
from wapstable.train.threads import CoreShare
with CoreShare():
    print("registered", flush=True)
    time.sleep(float(sys.argv[1]))
"""


def hold_registration(tmp_path, seconds=60):
    """Another trainer on this machine: a process holding a CoreShare registration in `tmp_path`."""
    env = {**os.environ, "WAPSTABLE_TRAINERS_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(seconds)], stdout=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout.readline().strip() == "registered"
    return proc


def test_auto_shares_the_cores_with_other_trainers_and_takes_them_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WAPSTABLE_TRAINERS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    before = torch.get_num_threads()
    try:
        with CoreShare(interval_s=0) as share:
            assert share.update() == 4  # alone: every core
            first = hold_registration(tmp_path)
            second = hold_registration(tmp_path)
            assert share.update() == 1  # three trainers on 4 cores: 1 thread each (rounded down)
            first.kill()
            first.wait()
            assert share.update() == 2  # the killed one's file is unlocked: deleted, not counted
            assert len(list(tmp_path.glob("*.trainer"))) == 2
            second.kill()
            second.wait()
            assert share.update() == 4
        assert not list(tmp_path.glob("*.trainer"))  # its own file goes when the run ends
    finally:
        torch.set_num_threads(before)


def test_trainers_on_other_cores_are_not_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("WAPSTABLE_TRAINERS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    other = hold_registration(tmp_path)  # runs on this machine's real cores
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1000, 1001})  # taskset to two other cores
        with CoreShare(interval_s=0) as share:
            assert share.update() == 2
    finally:
        other.kill()
        other.wait()
        torch.set_num_threads(before)


def test_a_run_beside_another_trainer_starts_with_its_share(tmp_path, cache_dir, monkeypatch, caplog):
    trainers = tmp_path / "trainers"
    other = hold_registration(trainers)  # on this machine's real cores, which the pretended ones include
    monkeypatch.setenv("WAPSTABLE_TRAINERS_DIR", str(trainers))
    share = unlike_this_machine()
    cores = 2 * share  # two trainers on them: half each
    try:
        log = train_on_cores(tmp_path, cache_dir, cores, monkeypatch, caplog)
    finally:
        other.kill()
        other.wait()
    assert f"; {share} threads" in log and f"; {cores} threads" not in log
    assert len(list(trainers.glob("*.trainer"))) == 1  # the run removed its own, not the other's


@pytest.mark.slow  # three tiny trainings after a warm-up, each in a fresh interpreter: make test-all
def test_share_cores_script_times_the_groups_side_by_side(tmp_path, cache_dir):
    out = tmp_path / "share.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "share_cores.py"),
        "--quick",
        "--steps",
        "3",
        "--counts",
        "2",
    ]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert set(res["groups"]) == {"1", "2"}  # the lone run is always measured
    assert len(res["groups"]["2"]["times_s"]) == 2
    assert res["groups"]["1"]["ratio"] == 1.0
    two = res["groups"]["2"]
    assert two["ratio"] == pytest.approx(two["slowest_s"] / res["groups"]["1"]["slowest_s"])
    assert res["machine"]["cores"] == len(os.sched_getaffinity(0))
    assert " at once " in proc.stdout and "x alone" in proc.stdout
