"""scripts/gpu_check.py (`make gpu-check`) on the CPU: its failure paths (no CUDA, a skip that changes a weight, a
guarded step that reads the device twice, a check that runs past its time limit) and the whole check with
`--device cpu --quick`. The real check on a GPU is marked `cuda` and skips without one."""

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, python_run

from wapstable.cli import gpu_check, gpu_checks
from wapstable.errors import UserError
from wapstable.stability.step_guard import StepGuard

SCRIPT = ROOT / "scripts" / "gpu_check.py"
QUICK = ["--device", "cpu", "--quick"]
DEFAULT = "tiny (default)"  # the config's own model as --quick has it (debug=tiny's), as the table labels it
PRECISIONS = ("32", "bf16", "fp16")
SCALE = re.compile(r"GradScaler scale (\d+) -> (\d+)")


def run_script(args, cache_dir, timeout=600, cuda=True, make=None):
    """`python scripts/gpu_check.py ARGS` (or the `make` command line given), as a process of its own."""
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), "HYDRA_FULL_ERROR": "1"}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch then sees no GPU, on any machine
    if make:
        return subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return python_run([sys.executable, str(SCRIPT), *args], env=env, timeout=timeout)


def table(out: str) -> dict[tuple[str, str, str], tuple[str, str, str]]:
    """The printed table: (check, model, precision) -> (result, figure, detail)."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| check "):
            cells = [c.strip() for c in line[2:-2].split(" | ", 5)]
            assert len(cells) == 6, line
            rows[tuple(cells[:3])] = tuple(cells[3:])
    return rows


def no_cuda_error(proc) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "error: the GPU check needs a CUDA GPU" in proc.stderr, proc.stderr
    assert "add --device cpu" in proc.stderr
    assert "| check " not in proc.stdout  # nothing was checked


def test_without_cuda_one_sentence_and_exit_2(cache_dir, monkeypatch):
    no_cuda_error(run_script([], cache_dir, cuda=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        gpu_check.main(["--quick"])


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_make_gpu_check_without_cuda(cache_dir):
    # -o: leave the environment as it is (no pip install); PY: this interpreter
    make = ["make", "-s", "-o", ".venv/.installed", "gpu-check", f"PY={sys.executable}", "ARGS=--quick"]
    proc = run_script([], cache_dir, cuda=False, make=make)
    assert "error: the GPU check needs a CUDA GPU" in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.returncode != 0


@pytest.mark.slow  # every check on the CPU, 10 s: make test-all; the failure paths stay in make test
def test_cpu_check_passes_and_prints_one_table(cache_dir):
    proc = run_script([*QUICK], cache_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("| check ") == 1
    rows = table(proc.stdout)
    expected = {
        (check, model, precision)
        for model in (DEFAULT, "densewap")
        for precision in PRECISIONS
        for check in ("nan skip", "host syncs", *(["fp16 overflow"] if precision == "fp16" else []))
    }
    expected |= {("ddp nccl", DEFAULT, "32"), ("ddp gloo", DEFAULT, "32"), ("samples/s", DEFAULT, "32")}
    assert set(rows) == expected, proc.stdout
    for key in expected - {("ddp nccl", DEFAULT, "32"), ("samples/s", DEFAULT, "32")}:
        assert rows[key][0] == "PASS", (key, rows[key])
    for model in (DEFAULT, "densewap"):
        for precision in PRECISIONS:
            assert rows[("nan skip", model, precision)][1] == "bit-exact"
            # the guard's one read per step, fp16 too: the guard steps the optimizer itself, not GradScaler.step
            assert rows[("host syncs", model, precision)][1] == "1/step"
        before, after = map(float, SCALE.search(rows[("nan skip", model, "fp16")][2]).groups())
        assert after == before / 2  # the NaN step backed the GradScaler's scale off
    assert (
        rows[("ddp nccl", DEFAULT, "32")][0] == "SKIP"
        and "NCCL needs CUDA" in rows[("ddp nccl", DEFAULT, "32")][2]
    )
    result, figure, detail = rows[("samples/s", DEFAULT, "32")]
    assert result == "SKIP" and figure.endswith("/s on the CPU") and float(figure.split("/")[0]) > 0
    assert "all checks passed" in proc.stdout


def guard_step_that(monkeypatch, before=None, after=None) -> None:
    """StepGuard.step with something done before it (to the loss) or after it (to the guard and its result)."""
    original = StepGuard.step

    def step(self, loss, *args, **kwargs):
        if before:
            before(loss)
        result = original(self, loss, *args, **kwargs)
        if after:
            after(self, result)
        return result

    monkeypatch.setattr(StepGuard, "step", step)


def test_a_skip_that_moves_a_weight_fails(cache_dir, monkeypatch, capsys):
    def nudge(guard, result):
        if result.skipped:
            with torch.no_grad():
                guard.params[0].add_(1e-3)

    guard_step_that(monkeypatch, after=nudge)
    assert gpu_check.main([*QUICK, "--models", "default", "--cache-dir", str(cache_dir)]) == 1
    out = capsys.readouterr().out
    rows = table(out)
    for precision in PRECISIONS:
        result, figure, detail = rows[("nan skip", DEFAULT, precision)]
        assert (result, figure) == ("FAIL", "not bit-exact"), detail
        assert detail.startswith("the skipped step changed model.watcher."), detail
        assert rows[("host syncs", DEFAULT, precision)][0] == "PASS"  # the failure shows where it is
    assert rows[("fp16 overflow", DEFAULT, "fp16")][0] == "FAIL"
    assert rows[("ddp gloo", DEFAULT, "32")][0] == "FAIL"
    assert "FAILED: 5 checks" in out


@pytest.mark.slow  # make test-all
def test_a_second_host_sync_per_step_fails(cache_dir, monkeypatch, capsys):
    # a second read of the device in every guarded step, before the guard's own
    guard_step_that(monkeypatch, before=lambda loss: float(loss.detach()))
    assert gpu_check.main([*QUICK, "--models", "default", "--cache-dir", str(cache_dir)]) == 1
    rows = table(capsys.readouterr().out)
    for precision in PRECISIONS:
        result, figure, detail = rows[("host syncs", DEFAULT, precision)]
        assert result == "FAIL" and figure.startswith("2/step"), (figure, detail)
        assert "more than one per step (target <= 1): " in detail and "test_gpu_check.py" in detail
        assert rows[("nan skip", DEFAULT, precision)][0] == "PASS"


@pytest.mark.slow  # make test-all; make test keeps a skip that moves a weight and the time limit
def test_a_counter_that_counts_nothing_fails(cache_dir, monkeypatch, capsys):
    """0 syncs per step is not a pass: the guard's own read is one, so a counter that sees none is broken."""
    monkeypatch.setattr(gpu_checks.SyncCounter, "_tensor_reads", lambda self: contextlib.nullcontext())
    assert gpu_check.main([*QUICK, "--models", "default", "--cache-dir", str(cache_dir)]) == 1
    rows = table(capsys.readouterr().out)
    for precision in PRECISIONS:
        result, figure, detail = rows[("host syncs", DEFAULT, precision)]
        assert (result, figure) == ("FAIL", "0/step"), detail
        assert "the counter is not counting" in detail
        assert rows[("nan skip", DEFAULT, precision)][0] == "PASS"


def test_the_counter_counts_a_host_read():
    """The CPU counter sees a read of a tensor's value, with the line that made it, and nothing else."""
    with gpu_checks.SyncCounter(cuda=False).counting() as counter:
        x = torch.ones(3) * 2  # work on the tensor, no read
        line = sys._getframe().f_lineno + 1
        value = x.sum().item()
    assert value == 6.0 and counter.total == 1
    assert dict(counter.where) == {f"test_gpu_check.py:{line}": 1}


def test_past_the_time_limit_prints_what_finished_and_exits_1(cache_dir):
    proc = run_script([*QUICK, "--time-limit", "0.5"], cache_dir)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result, figure, _ = table(proc.stdout)[("time limit", "-", "-")]
    assert (result, figure) == ("FAIL", "0.5 s")
    assert "FAILED" in proc.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU check needs a CUDA GPU")
def test_gpu_check_on_cuda(cache_dir):
    proc = run_script([], cache_dir)
    rows = table(proc.stdout)
    failed = {k: v for k, v in rows.items() if v[0] == "FAIL"}
    assert proc.returncode == 0 and not failed, proc.stdout + proc.stderr[-5000:]
    assert rows[("ddp nccl", DEFAULT, "32")][0] == "PASS"
    assert rows[("samples/s", DEFAULT, "32")][0] == "PASS"
    for model in (DEFAULT, "densewap"):
        for precision in ("32", "fp16"):  # bf16 may be SKIP on a GPU older than compute capability 8
            assert rows[("nan skip", model, precision)][0] == "PASS"
            # the guard's one read per step, seen: a counter that reads 0 fails here (and in the check itself)
            assert rows[("host syncs", model, precision)][:2] == ("PASS", "1/step")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the counter's CUDA mode needs a CUDA GPU")
def test_the_cuda_counter_counts_a_sync():
    """set_sync_debug_mode's warnings are counted: a read of a CUDA tensor's value is at least one sync, device work
    alone none."""
    with gpu_checks.SyncCounter(cuda=True).counting() as idle:
        x = torch.ones(3, device="cuda") * 2
    with gpu_checks.SyncCounter(cuda=True).counting() as read:
        value = x.sum().item()
    assert idle.total == 0 and read.total >= 1 and value == 6.0
