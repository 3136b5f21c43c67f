"""Shared helpers: composing the real config, and running the real `train.py` in a subprocess."""

import atexit
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from wapstable.config import CONF_DIR, TINY_OVERRIDES, quote_group_options, register_configs

ROOT = Path(__file__).resolve().parents[1]
register_configs()
# trainer.threads=auto counts the trainers running on the machine (wapstable/train/threads.py): the tests' runs
# count only each other, so their thread counts do not depend on what else runs here.
os.environ["WAPSTABLE_TRAINERS_DIR"] = tempfile.mkdtemp(prefix="wapstable-test-trainers-")
torch.set_num_threads(1)  # the in-process tests too, as TINY's trainer.threads=1

# Tiny settings that keep a real run of train.py to seconds on a CPU: debug=tiny (conf/debug/tiny.yaml) and a few
# steps.
TINY = [
    *TINY_OVERRIDES,
    # WAP's Adadelta (lr 1.0, constant): the guard, rollback and fault tests were written against it, and their
    # figures (an lr halved from 1.0 to 0.5) read plainly; the default optimizer has its own smoke run.
    "optim=adadelta",
    "trainer.max_steps=3",
    "trainer.eval_every=3",
    "trainer.checkpoint_every=3",
    "trainer.progress=false",
    # make test runs two test processes at once (pytest-xdist, -n 2): one thread per training keeps them from
    # waiting on each other's spinning OpenMP threads, and a tiny model trains as fast on one
    "trainer.threads=1",
]

# An lr spike at step 4, accepted, makes the loss of step 5 a spike that guard.skip_spikes skips (after 3 warm-up
# steps, at a z-score of 3): the tests of spike skips, in the trainer and across a resume.
SPIKE_AT_STEP_5 = [
    "guard.skip_spikes=true",
    "guard.spike_warmup=3",
    "guard.spike_zscore=3",
    "fault=lr_spike",
    "fault.step=4",
    "fault.scale=1e3",
]


VGG = "wapstable.model.watchers.vgg.VGGWatcher"
DENSE = "wapstable.model.watchers.dense.DenseWatcher"


def vgg(channels, **options) -> dict:
    """`model.watcher` for the VGG watcher of `channels` and its other `options`."""
    return {"_target_": VGG, "channels": list(channels), **options}


def outside_the_package(tmp_path, module: str, code: str, option: str, yaml: str) -> tuple[str, dict]:
    """A part kept outside the package: `code` as module `module` in a folder of its own, and `yaml` as the config
    option `option` ("clip/scale") in a config folder of the user's. Returns the hydra.searchpath override and the
    environment (PYTHONPATH) that find them."""
    code_dir = tmp_path / "mine"
    code_dir.mkdir(exist_ok=True)
    (code_dir / f"{module}.py").write_text(code)
    conf = tmp_path / "myconf" / f"{option}.yaml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(yaml)
    return f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", {"PYTHONPATH": str(code_dir)}


def compose_config(overrides=(), run_dir=None):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=quote_group_options(list(overrides)))
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    return cfg


def build_trainer(overrides, run_dir, cache_dir):
    """The real Trainer, in this process, from the composed config with `overrides`, reading the session's data
    cache: for tests that drive its steps themselves."""
    from wapstable.train.loop import Trainer

    cfg = compose_config(overrides, run_dir=run_dir)
    cfg.data.cache_dir = str(cache_dir)
    return Trainer(cfg)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One synthetic-data cache for the whole session, so tiny data sets render once."""
    return tmp_path_factory.mktemp("cache")


class Zygote:
    """The session's pre-imported Python (tests/zygote.py): `run` forks a child per command."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.buffer = b""

    def start(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "zygote.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=ROOT,
            )
            self.buffer = b""

    def message(self, timeout: float | None) -> dict | None:
        """The parent's next line, or None when `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the tests' zygote process died")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv, cwd, env, timeout) -> subprocess.CompletedProcess:
        self.start()
        with tempfile.TemporaryDirectory(prefix="wapstable-run-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = self.message(60)["pid"]
            done = self.message(timeout)
            if done is None:
                os.kill(pid, signal.SIGKILL)
                self.message(None)
                raise subprocess.TimeoutExpired(
                    [sys.executable, *argv], timeout, out.read_text(), err.read_text()
                )
            return subprocess.CompletedProcess(
                [sys.executable, *argv],
                done["rc"],
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


ZYGOTE = Zygote()
atexit.register(ZYGOTE.stop)
# WAPSTABLE_TEST_FRESH=1 (make test-all's second pass): every run in a fresh interpreter, as a user starts it.
FRESH = os.environ.get("WAPSTABLE_TEST_FRESH") == "1"
HASH_SEEDS = itertools.count(1 + os.getpid() % 1000 * 100)


def python_run(cmd, cwd=ROOT, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` for `cmd = [sys.executable, SCRIPT or -m MODULE, ...]`,
    run as a child of the pre-imported zygote (seconds faster per run; tests/zygote.py says how it stays a real
    process). Anything else, or WAPSTABLE_TEST_FRESH=1, runs in a fresh interpreter."""
    env = dict(os.environ if env is None else env)
    if FRESH and "PYTHONHASHSEED" not in env:
        # every fresh process its own hash salt, so that two runs a test compares differ in it as two runs of a
        # user's would (forked children all share the zygote's)
        env["PYTHONHASHSEED"] = str(next(HASH_SEEDS))
    fresh = (
        cmd[0] != sys.executable
        or cmd[1].startswith("-")
        and cmd[1] != "-m"
        or FRESH
        or any(env.get(k) != os.environ.get(k) for k in ("PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS"))
    )
    if fresh:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return ZYGOTE.run([str(a) for a in cmd[1:]], cwd, env, timeout)


def require_extra(module: str, extra: str):
    """Import a module of an optional extra (`sweep`, `loggers`). Missing, it FAILS the test, not skips it: `make
    test` installs the extras (dev includes them), so a missing one is a broken environment whose tests must not
    quietly vanish."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(
            f"{module} is not installed ({e}); it is in the {extra} extra, which the tests need: "
            "pip install -e '.[dev]' (or make test, which installs it)",
            pytrace=False,
        )


def run_train(args, run_dir, cache_dir, check=True, timeout=600, env_extra=None, tiny=True):
    """Run the real `python train.py` with tiny settings into `run_dir`; returns the CompletedProcess."""
    base = TINY if tiny else []
    if any(a.startswith("resume=") for a in args):  # a resumed run takes its optimizer from the checkpoint
        base = [a for a in base if not a.startswith("optim=")]
    cmd = [sys.executable, str(ROOT / "train.py"), *base, f"hydra.run.dir={run_dir}", *args]
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), "HYDRA_FULL_ERROR": "1", **(env_extra or {})}
    proc = python_run(cmd, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def refusal_in_process(args, run_dir, cache_dir) -> str:
    """The one sentence `train()` refuses `args` with (tiny settings), in this process: the refusal's logic at a
    fraction of a process's cost. The families of refusals check every case this way and a few through the real
    `python train.py` (exit status, stderr, nothing written), the rest of those under `make test-all`."""
    from wapstable.errors import UserError
    from wapstable.train.stages import train

    cfg = compose_config([*TINY, *args], run_dir=run_dir)
    cfg.data.cache_dir = str(cache_dir)
    with pytest.raises(UserError) as refused:
        train(cfg)
    assert not (Path(run_dir) / "metrics.json").exists() and not (Path(run_dir) / "checkpoints").exists()
    return str(refused.value)


def run_multirun(args, sweep_dir, cache_dir, check=True, timeout=1200):
    """`python train.py -m` with tiny settings into `sweep_dir` (one process, every job in it)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY, f"hydra.sweep.dir={sweep_dir}", *args]
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), "HYDRA_FULL_ERROR": "1"}
    proc = python_run(cmd, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py -m failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def assert_identical(a, b, path=""):
    """Nested states (tensors, dicts, lists, numbers) equal bit for bit; the path names the first difference."""
    import torch

    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path
