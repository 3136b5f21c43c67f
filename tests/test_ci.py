""".ci/run's install smoke (scripts/ci_smoke.sh) fails CI when it cannot run, unless the machine is marked with
WAPSTABLE_CI_NO_SMOKE=1. Run with stand-ins on PATH: a `make` that records its arguments, Pythons that exist or
not, and a `df` that reports the free disk; the real smoke (6 GB of pip installs) is not run here."""

import os
import subprocess

import pytest
from conftest import ROOT

SMOKE = ROOT / "scripts" / "ci_smoke.sh"
GB = 1048576  # df -k's 1 KiB blocks in a GiB


def stub(folder, name, body):
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path):
    """A machine of stand-ins: `make` appends its arguments to make.log; has(...) installs Pythons; disk(gb) sets
    the free space df reports. run(script, marked) runs `script` on it; returns (exit status, stderr, make calls)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "make.log"
    bin_dir.mkdir()
    stub(bin_dir, "make", f'echo "$*" >> "{log}"')
    for version in ("3.12", "3.13"):  # absent until has() installs them: shadows any on the real PATH
        stub(bin_dir, f"python{version}", "exit 127")

    class Machine:
        def has(self, *versions):
            for version in versions:
                stub(bin_dir, f"python{version}", "exit 0")

        def disk(self, gb):
            stub(
                bin_dir,
                "df",
                f"echo 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                f"echo 'disk 1 1 {gb * GB} 1% /'",
            )

        def run(self, script=SMOKE, marked=None):
            env = {k: v for k, v in os.environ.items() if k != "WAPSTABLE_CI_NO_SMOKE"}
            env["PATH"] = f"{bin_dir}:/usr/bin:/bin"  # no pyenv shims, no real python3.12 / python3.13 first
            if marked is not None:
                env["WAPSTABLE_CI_NO_SMOKE"] = marked
            proc = subprocess.run(
                [str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
            )
            calls = log.read_text().splitlines() if log.exists() else []
            return proc.returncode, proc.stderr, calls

    m = Machine()
    m.disk(100)
    return m


def test_a_missing_python_fails(machine):
    code, err, calls = machine.run()
    assert code == 1 and "error: no python3.12 on this machine" in err and "WAPSTABLE_CI_NO_SMOKE=1" in err
    assert calls == []
    machine.has("3.12")  # the first one runs; the second is missing: still a failure
    code, err, calls = machine.run()
    assert code == 1 and "error: no python3.13" in err and calls == ["smoke PYTHON=python3.12"]


def test_too_little_disk_fails(machine):
    machine.has("3.12", "3.13")
    machine.disk(11)
    code, err, calls = machine.run()
    assert code == 1 and "only 11 GB free" in err and "WAPSTABLE_CI_NO_SMOKE=1" in err and calls == []


def test_a_machine_that_can_runs_the_smoke_on_both(machine):
    machine.has("3.12", "3.13")
    code, err, calls = machine.run()
    assert code == 0, err
    assert calls == ["smoke PYTHON=python3.12", "smoke PYTHON=python3.13"]


def test_a_marked_machine_skips_it_saying_so(machine):
    code, err, calls = machine.run(marked="1")
    assert code == 0 and "SKIPPED: WAPSTABLE_CI_NO_SMOKE=1" in err and calls == []
    code, _, _ = machine.run(marked="0")  # only 1 marks it
    assert code == 1


def test_pyenv_without_the_version_fails_with_the_sentence(machine, tmp_path):
    stub(tmp_path / "bin", "pyenv", "echo 3.11.7")  # pyenv knows no 3.12 or 3.13
    code, err, _ = machine.run()
    assert code == 1 and "error: no python3.12" in err


def test_ci_run_fails_after_the_suite_when_the_smoke_cannot_run(machine):
    """.ci/run itself (its `make test`, `make test-all`, `make lint` stand-ins): the exit status is the smoke's."""
    code, err, calls = machine.run(ROOT / ".ci" / "run")
    assert code == 1 and "error: no python3.12" in err
    assert calls == ["test", "test-all", "lint"]
    code, err, _ = machine.run(ROOT / ".ci" / "run", marked="1")
    assert code == 0 and "SKIPPED" in err
