"""Crash safety through the real train.py: SIGKILL anywhere, resume=auto, SIGTERM, a dying data-loading worker.

The killed runs are real subprocesses. To kill one at a known point, it runs train.py under a small wrapper
(HOOKS) that pauses it there and touches a marker file; the test waits for the marker and kills it. The hooks live
here, not in the package: they patch the trainer from outside, in the child process only.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, require_extra, run_multirun, run_train

from wapstable.checkpoint import load_checkpoint, save_checkpoint
from wapstable.train.build import resolve_resume

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

# Run train.py with the hooks that the environment asks for. PAUSE_AT_STEP=k: in step k (0-based), after backward
# and before the optimizer step. PAUSE_IN_SAVE=k: while writing last.pt at step k, with half of it in the
# temporary file. CRASH_WORKER=1: a data-loading worker is killed as by the out-of-memory killer. A pause touches
# $MARKER and waits until $MARKER.release exists.
HOOKS = r"""
import io, os, runpy, signal, sys, time
from pathlib import Path

import torch
import torch.utils.data

import wapstable.data.batches
import wapstable.stability.step_guard as step_guard
import wapstable.train.loop as trainer

env = os.environ


def pause():
    Path(env["MARKER"]).touch()
    while not Path(env["MARKER"] + ".release").exists():
        time.sleep(0.02)


if "PAUSE_AT_STEP" in env:
    at, now = int(env["PAUSE_AT_STEP"]), {}
    train_step, plan = trainer.Trainer.train_step, step_guard.plan_clip

    def step_hook(self, *args, **kwargs):
        now["step"] = self.step
        return train_step(self, *args, **kwargs)

    def plan_hook(*args, **kwargs):  # after backward, before the optimizer step
        if now.get("step") == at:
            pause()
        return plan(*args, **kwargs)

    trainer.Trainer.train_step, step_guard.plan_clip = step_hook, plan_hook

if "PAUSE_IN_SAVE" in env:
    at, save = int(env["PAUSE_IN_SAVE"]), torch.save

    def save_hook(obj, f, *args, **kwargs):
        # no evaluation at this step, so the only checkpoint written at it is last.pt
        if obj.get("state", {}).get("step") == at and "anomaly" not in obj["state"]:
            buf = io.BytesIO()
            save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            pause()
        return save(obj, f, *args, **kwargs)

    torch.save = save_hook

if "CRASH_WORKER" in env:
    getitem = wapstable.data.batches._BatchDataset.__getitem__

    def getitem_hook(self, i):
        if torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return getitem(self, i)

    wapstable.data.batches._BatchDataset.__getitem__ = getitem_hook

sys.argv[0] = str(Path.cwd() / "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# 12 steps, a checkpoint every 2, evaluations at 4, 8 and 12; dropout and Adam so that the RNG and the optimizer
# state must be restored exactly for the weights to match.
COMMON = [
    "trainer.max_steps=12",
    "trainer.checkpoint_every=2",
    "trainer.eval_every=4",
    "model.dropout=0.3",
    "optim=adam",
]
WAIT = 180  # seconds: generous, for a slow and busy machine


class Run:
    """train.py under HOOKS in a subprocess, its output in a file."""

    def __init__(self, tmp_path, name, run_dir, cache_dir, args, **hooks):
        self.marker = tmp_path / f"{name}.marker"
        self.output = tmp_path / f"{name}.out"
        env = {
            **os.environ,
            "WAPSTABLE_CACHE": str(cache_dir),
            "HYDRA_FULL_ERROR": "1",
            "MARKER": str(self.marker),
            **{k: str(v) for k, v in hooks.items()},
        }
        cmd = [sys.executable, "-c", HOOKS, *TINY, f"hydra.run.dir={run_dir}", *args]
        with open(self.output, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.output.read_text()

    def wait_for_pause(self) -> None:
        deadline = time.monotonic() + WAIT
        while not self.marker.exists():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"train.py ended ({self.proc.returncode}) before the pause:\n{self.text()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"train.py did not reach the pause in {WAIT} s:\n{self.text()}")
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT)

    def release(self) -> None:
        Path(f"{self.marker}.release").touch()

    def wait(self) -> int:
        try:
            return self.proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"train.py did not end in {WAIT} s:\n{self.text()}") from None


def step_of(path: Path) -> int:
    return load_checkpoint(path)["step"]


def tensors(state, prefix=""):
    """Every tensor of a nested state, by its path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else []
    return {k: v for key, value in items for k, v in tensors(value, f"{prefix}/{key}").items()}


@pytest.mark.slow
def test_killed_anywhere_resumes_to_the_same_weights(tmp_path, cache_dir):
    straight = tmp_path / "straight"
    reference = subprocess.Popen(  # the uninterrupted run, alongside the interrupted one
        [sys.executable, "train.py", *TINY, f"hydra.run.dir={straight}", *COMMON],
        cwd=ROOT,
        env={**os.environ, "WAPSTABLE_CACHE": str(cache_dir)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.pt"
    auto = [*COMMON, "resume=auto"]

    # 1. SIGKILL in step 1, before the first checkpoint: nothing to resume from.
    r = Run(tmp_path, "1", run, cache_dir, auto, PAUSE_AT_STEP=1)
    r.wait_for_pause()
    r.kill()
    assert not last.exists()

    # 2. resume=auto starts fresh; SIGKILL in step 5, between the checkpoints of steps 4 and 6.
    r = Run(tmp_path, "2", run, cache_dir, auto, PAUSE_AT_STEP=5)
    r.wait_for_pause()
    r.kill()
    assert "resume=auto: no " in r.text() and "starting fresh" in r.text()
    assert step_of(last) == 4

    # 3. resumes from step 4; SIGKILL inside the write of last.pt at step 6, half of it on disk.
    r = Run(tmp_path, "3", run, cache_dir, auto, PAUSE_IN_SAVE=6)
    r.wait_for_pause()
    r.kill()
    assert f"resuming from {last} (step 4)" in r.text()
    [partial] = (run / "checkpoints").glob(".last.pt.*.tmp")
    assert partial.stat().st_size > 0
    assert step_of(last) == 4  # the old checkpoint, whole

    # 4. SIGTERM in step 9: the step ends, last.pt is written, the run exits with 143 and no metrics.
    r = Run(tmp_path, "4", run, cache_dir, auto, PAUSE_AT_STEP=9)
    r.wait_for_pause()
    r.proc.send_signal(signal.SIGTERM)
    r.release()
    assert r.wait() == 143, r.text()
    assert "SIGTERM: checkpoint written at step 10; resume with resume=auto" in r.text()
    assert "Traceback" not in r.text()
    assert step_of(last) == 10 and not (run / "metrics.json").exists()
    assert not list((run / "checkpoints").glob("*.tmp"))  # the next write cleared the killed write's leftover

    # 5. resume=auto runs to the end.
    proc = run_train(auto, run, cache_dir)
    assert "resuming from" in proc.stdout + proc.stderr

    assert reference.wait(WAIT) == 0
    for name in ("last.pt", "best.pt"):
        a = load_checkpoint(straight / "checkpoints" / name)
        b = load_checkpoint(run / "checkpoints" / name)
        assert a["step"] == b["step"], name
        want, got = (
            tensors({k: a[k] for k in ("model", "optimizer")}),
            tensors({k: b[k] for k in ("model", "optimizer")}),
        )
        assert want.keys() == got.keys() and want
        for k in want:
            assert torch.equal(want[k], got[k]), (name, k)
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (straight, run))
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert a == b


@pytest.mark.slow  # make test-all
def test_dead_data_loader_worker_is_a_clear_error(tmp_path, cache_dir):
    r = Run(tmp_path, "worker", tmp_path / "run", cache_dir, ["data.batch.num_workers=1"], CRASH_WORKER=1)
    assert r.wait() == 2, r.text()  # not a hang: the wait would time out
    out = r.text()
    assert "error: a data-loading worker failed" in out and "data.batch.num_workers=0" in out, out
    assert "Traceback" not in out


def test_resume_auto_resolves_to_last_pt_or_fresh(tmp_path):
    cfg = type("Cfg", (), {})()
    cfg.resume = "auto"
    assert resolve_resume(cfg, tmp_path) is None
    save_checkpoint({"step": 1}, tmp_path / "checkpoints" / "last.pt")
    assert resolve_resume(cfg, tmp_path) == tmp_path / "checkpoints" / "last.pt"
    cfg.resume = None
    assert resolve_resume(cfg, tmp_path) is None
    cfg.resume = str(tmp_path / "other.pt")
    assert resolve_resume(cfg, tmp_path) == tmp_path / "other.pt"


def test_a_killed_write_leaves_the_old_checkpoint_and_is_cleaned_up(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    leftover = tmp_path / ".last.pt.abc123.tmp"  # what SIGKILL inside a write leaves
    leftover.write_bytes(path.read_bytes()[:100])
    other = tmp_path / ".best.pt.abc123.tmp"  # another file's write: not ours to remove
    other.write_bytes(b"x")
    assert load_checkpoint(path)["step"] == 1
    save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert load_checkpoint(path)["step"] == 2
    assert not leftover.exists() and other.exists()


def same_training_state(a_dir: Path, b_dir: Path) -> None:
    """last.pt's model and optimizer tensors equal bit for bit, and the same metrics but for the wall time."""
    a, b = (load_checkpoint(d / "checkpoints" / "last.pt") for d in (a_dir, b_dir))
    assert a["step"] == b["step"]
    want, got = (tensors({k: s[k] for k in ("model", "optimizer")}) for s in (a, b))
    assert want.keys() == got.keys() and want
    for k in want:
        assert torch.equal(want[k], got[k]), k
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a_dir, b_dir))
    ma.pop("wall_time_s"), mb.pop("wall_time_s")
    assert ma == mb


def test_sigusr2_checkpoints_exits_for_requeue_and_resumes_bit_identical(tmp_path, cache_dir):
    """SLURM's (and submitit's) preemption signal: the step ends, last.pt is written, exit 144 asks for a
    requeue, and resume=auto ends where an uninterrupted run ends, bit for bit. While the run holds its directory, a
    second process started on it is refused and writes nothing."""
    straight = tmp_path / "straight"
    run_train(COMMON, straight, cache_dir)
    run = tmp_path / "run"
    auto = [*COMMON, "resume=auto"]
    r = Run(tmp_path, "usr2", run, cache_dir, auto, PAUSE_AT_STEP=5)
    r.wait_for_pause()
    refuses_a_second_process(r, run, cache_dir)
    r.proc.send_signal(signal.SIGUSR2)
    r.release()
    assert r.wait() == 144, r.text()
    assert "SIGUSR2: checkpoint written at step 6; resume with resume=auto" in r.text()
    assert "Traceback" not in r.text()
    assert step_of(run / "checkpoints" / "last.pt") == 6 and not (run / "metrics.json").exists()
    proc = run_train(auto, run, cache_dir)
    assert f"resuming from {run / 'checkpoints' / 'last.pt'} (step 6)" in proc.stdout + proc.stderr
    same_training_state(straight, run)


@pytest.mark.slow
def test_a_preempted_submitit_job_requeues_itself_and_finishes_bit_identical(tmp_path, cache_dir):
    """fault=preempt sends the job SIGUSR2 in step 5 under Hydra's submitit launcher: the trainer writes last.pt,
    submitit's handler requeues the job (its checkpoint hook), and the requeued job resumes with resume=auto."""
    require_extra("hydra_plugins.hydra_submitit_launcher", "sweep")
    straight = tmp_path / "straight"
    run_train(COMMON, straight, cache_dir)
    sweep = tmp_path / "sweep"
    args = [*COMMON, "resume=auto", "fault=preempt", "fault.step=5", "hydra/launcher=submitit_local"]
    run_multirun([*args, "hydra.launcher.timeout_min=5"], sweep, cache_dir)
    logs = "".join(p.read_text() for p in sorted((sweep / ".submitit").rglob("*_log.*")))
    assert "SIGUSR2: checkpoint written at step 6" in logs and "Requeued job" in logs, logs[-3000:]
    assert "resuming from" in logs
    same_training_state(straight, sweep / "0")


def listing(run: Path) -> dict:
    """Every file under a run directory with its size and modification time."""
    return {
        str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in run.rglob("*")
        if p.is_file()
    }


def refuses_a_second_process(holder: "Run", run: Path, cache_dir) -> None:
    """resume=auto started again, and a fresh run into the directory: exit 2, one sentence, nothing written (not even
    Hydra's .hydra/ files or train.log)."""
    before = listing(run)
    for args in ([*COMMON, "resume=auto"], COMMON):
        second = run_train(args, run, cache_dir, check=False)
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert f"{run} is in use by another training process (PID {holder.proc.pid})" in out, out
        assert "Traceback" not in out
        assert listing(run) == before


@pytest.mark.slow  # make test-all; make test refuses the second process in the SIGUSR2 test above
def test_a_second_process_on_a_run_directory_is_refused_and_a_killed_one_leaves_no_lock(tmp_path, cache_dir):
    run = tmp_path / "run"
    auto = [*COMMON, "resume=auto"]
    r = Run(tmp_path, "holder", run, cache_dir, auto, PAUSE_AT_STEP=5)
    r.wait_for_pause()
    refuses_a_second_process(r, run, cache_dir)
    r.kill()  # SIGKILL: the OS drops the lock with the process
    proc = run_train(auto, run, cache_dir)
    assert "resuming from" in proc.stdout + proc.stderr
    assert json.loads((run / "metrics.json").read_text())["steps"] == 12
