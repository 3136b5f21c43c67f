"""A non-editable install: `pip install` of a clean copy of the checkout into a folder, then every console command
run from a folder outside the checkout, importing only the installed package and its configs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

COMMANDS = [
    "wapstable-train",
    "wapstable-evaluate",
    "wapstable-predict",
    "wapstable-render",
    "wapstable-replay",
    "wapstable-grad-report",
    "wapstable-summarize-sweep",
    "wapstable-bench",
    "wapstable-figures",
    "wapstable-share-cores",
    "wapstable-gpu-check",
    "wapstable-layout-stats",
]


def clean_copy(dest: Path) -> None:
    """The files a clone of this working tree would hold: tracked and new files, not ignored ones (no .venv, no
    build/, no egg-info); links stay links, as git keeps them."""
    # Not a skip: make test (and CI, .ci/run) runs in a clone, so without git this test would quietly vanish.
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.fail(
            f"{ROOT} is not a git checkout (or git is not on PATH): this test copies the files a clone holds "
            "(git ls-files); run the tests in a clone of the repository",
            pytrace=False,
        )
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src, dst = ROOT / name, dest / name
        if not src.is_symlink() and not src.exists():  # deleted in the working tree, not yet committed
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(target folder, environment): `pip install --target` of a clean copy; PYTHONPATH puts it first."""
    tmp = tmp_path_factory.mktemp("install")
    src, target = tmp / "src", tmp / "target"
    clean_copy(src)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
    ]
    subprocess.run([*cmd, "--target", str(target), str(src)], check=True, capture_output=True, timeout=600)
    shutil.rmtree(src)  # nothing of the source is left to import by mistake
    return target, {**os.environ, "PYTHONPATH": str(target), "HYDRA_FULL_ERROR": "1"}


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """A working folder outside the checkout."""
    path = tmp_path_factory.mktemp("elsewhere")
    assert ROOT not in path.parents
    return path


def command(installed, elsewhere, name, *args, env_extra=None):
    target, env = installed
    return subprocess.run(
        [str(target / "bin" / name), *map(str, args)],
        cwd=elsewhere,
        env={**env, **(env_extra or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def explain(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_console_commands_after_a_non_editable_install(installed, elsewhere, cache_dir):
    target, env = installed
    assert all((target / "bin" / c).is_file() for c in COMMANDS)
    where = subprocess.run(
        [sys.executable, "-c", "import wapstable.config as c; print(c.__file__); print(c.CONF_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(target) for p in where)
    conf = Path(where[1])
    assert (
        not conf.is_symlink() and (conf / "debug" / "tiny.yaml").is_file()
    )  # copies, not a link to a checkout

    # Train 20 tiny steps with a NaN batch at step 5: a checkpoint to evaluate, an anomaly to replay, statistics.
    cache = {"WAPSTABLE_CACHE": str(cache_dir)}
    train_args = ["debug=tiny", "trainer.max_steps=20", "trainer.eval_every=10", "trainer.progress=false"]
    fault = ["fault=nan_input", "fault.step=5", "stats.every=2"]
    proc = command(installed, elsewhere, "wapstable-train", *train_args, *fault, env_extra=cache)
    assert proc.returncode == 0, explain(proc)
    [run] = list((elsewhere / "outputs").glob("*/*"))  # Hydra's default outputs/DATE/TIME, under the cwd
    assert json.loads((run / "metrics.json").read_text())["steps"] == 20
    hydra = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]
    sources = hydra["runtime"]["config_sources"]
    [main] = [s for s in sources if s["provider"] == "main"]
    assert Path(main["path"].removeprefix("file://")) == conf  # the installed configs, not the checkout's
    best = run / "checkpoints" / "best.pt"

    proc = command(installed, elsewhere, "wapstable-evaluate", best, "decode.beam_size=2")
    assert proc.returncode == 0, explain(proc)
    assert "exprate" in proc.stdout and (run / "checkpoints" / "eval-test.json").is_file()

    proc = command(installed, elsewhere, "wapstable-replay", run / "anomalies" / "step-5.pt")
    assert proc.returncode == 1, explain(proc)  # 1: the anomaly reproduced
    assert "REPRODUCED" in proc.stdout

    proc = command(installed, elsewhere, "wapstable-grad-report", run)
    assert proc.returncode == 0, explain(proc)
    assert (run / "grad_report.png").stat().st_size > 10_000 and "| 5 | yes |" in proc.stdout

    proc = command(installed, elsewhere, "wapstable-render", "x^{2}", "x.png", "--font-size", "16")
    assert proc.returncode == 0, explain(proc)
    proc = command(installed, elsewhere, "wapstable-predict", best, "x.png", "--beam", "2")
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.startswith("x.png\t")

    # Any folder of Hydra job directories: here the outputs/ folder holding the one run.
    proc = command(installed, elsewhere, "wapstable-summarize-sweep", elsewhere / "outputs", "--no-plot")
    assert proc.returncode == 0, explain(proc)
    assert "1 jobs, 0 failed" in proc.stdout and (elsewhere / "outputs" / "summary.csv").is_file()

    # The pictures that need no training, and the ExpRate curve of the run: the installed data config is found.
    proc = command(installed, elsewhere, "wapstable-figures", "--only", "samples", "exprate", "--run", run)
    assert proc.returncode == 0, explain(proc)
    assert all((elsewhere / "docs" / f).is_file() for f in ("samples.png", "exprate-curve.png"))


def test_a_console_command_reports_a_user_error_in_one_line(installed, elsewhere):
    proc = command(installed, elsewhere, "wapstable-grad-report", elsewhere)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "grad_stats.csv does not exist" in proc.stderr
