"""Sweeps: Hydra multirun (basic, joblib and submitit_local launchers), the Optuna search, and the sweep summary."""

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, TINY
from hydra import compose, initialize_config_dir

spec = importlib.util.spec_from_file_location("summarize_sweep", ROOT / "scripts" / "summarize_sweep.py")
summarize_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize_sweep)


def needs(plugin: str):
    return pytest.importorskip(
        f"hydra_plugins.{plugin}", reason=f"{plugin} is in the sweep extra: pip install -e '.[sweep]'"
    )


def multirun(args, sweep_dir, cache_dir, timeout=600):
    """`python train.py -m` with tiny settings into `sweep_dir`; returns the CompletedProcess."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY, f"hydra.sweep.dir={sweep_dir}", *args]
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def explain(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def summary_rows(sweep_dir, capsys) -> tuple[list[dict], str]:
    assert summarize_sweep.main([str(sweep_dir)]) == 0
    printed = capsys.readouterr().out
    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f)), printed


@pytest.mark.slow
def test_grid_sweep_runs_every_combination_and_is_summarised(tmp_path, cache_dir, capsys):
    sweep = tmp_path / "sweep"
    proc = multirun(["clip=none,norm", "optim.lr=0.5,1.0"], sweep, cache_dir)
    assert proc.returncode == 0, explain(proc)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    combos = set()
    for job in jobs:
        assert (job / "metrics.json").is_file()
        cfg = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        combos.add((cfg["clip"]["mode"], cfg["optim"]["lr"]))
    assert combos == {("none", 0.5), ("none", 1.0), ("norm", 0.5), ("norm", 1.0)}

    rows, printed = summary_rows(sweep, capsys)
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    # The columns: the overrides that differ (not the tiny settings every job shares), then the figures.
    assert list(rows[0])[:4] == ["job", "status", "clip", "optim.lr"]
    assert {
        "best_valid_exprate",
        "test_exprate",
        "skipped_steps",
        "anomalies",
        "clip_fraction",
        "wall_time_s",
    } <= set(rows[0])
    assert {(r["clip"], r["optim.lr"]) for r in rows} == {
        ("none", "0.5"),
        ("none", "1.0"),
        ("norm", "0.5"),
        ("norm", "1.0"),
    }
    assert "data.num_train" not in printed
    table = [line for line in printed.splitlines() if line.split()[:2][-1:] == ["ok"]]
    assert len(table) == 4
    assert (sweep / "summary.md").read_text().count("| ok |") == 4
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_failed_job_is_a_failed_row_and_the_sweep_goes_on(tmp_path, cache_dir, capsys):
    # Through joblib, two jobs at once; clip.max_norm=-1 fails its job with a UserError, the other still runs.
    needs("hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    proc = multirun(
        ["clip.max_norm=1,-1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], sweep, cache_dir
    )
    assert proc.returncode != 0  # Hydra reports the failure once every job has run
    assert (sweep / "0" / "metrics.json").is_file() and not (sweep / "1" / "metrics.json").exists()
    rows, printed = summary_rows(sweep, capsys)
    assert [(r["clip.max_norm"], r["status"]) for r in rows] == [("1", "ok"), ("-1", "failed")]
    assert "clip.max_norm=-1.0 must be positive" in rows[1]["note"]
    assert "1 failed" in printed and "failed" in (sweep / "summary.md").read_text()
    assert (sweep / "summary.png").is_file()


@pytest.mark.slow
def test_optuna_search_returns_the_configured_metric(tmp_path, cache_dir, capsys):
    # Two trials; the metric is the wall time (minimised), which differs between trials where ExpRate is 0 for both,
    # so the best value shows that train() returned the configured metric.
    needs("hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    args = [
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "optimize_metric=wall_time_s",
        "hydra.sweeper.direction=minimize",
    ]
    proc = multirun(args, sweep, cache_dir)
    assert proc.returncode == 0, explain(proc)
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(result["best_params"]) == {"optim.lr", "clip", "clip.max_norm", "clip.value"}
    times = [json.loads((sweep / j / "metrics.json").read_text())["wall_time_s"] for j in ("0", "1")]
    assert result["best_value"] == min(times)
    rows, printed = summary_rows(sweep, capsys)
    assert len(rows) == 2 and "Optuna best" in printed


@pytest.mark.slow
def test_submitit_local_sweep_with_a_stopped_job(tmp_path, cache_dir, capsys):
    # Each job a subprocess under submitit; the inf_loss job exhausts its skip budget and stops (TrainingStopped).
    needs("hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    args = [
        "fault=none,inf_loss",
        "fault.step=0",
        "fault.steps=10",
        "guard.max_consecutive_skips=1",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=5",
    ]
    proc = multirun(args, sweep, cache_dir)
    assert proc.returncode != 0
    assert (sweep / ".submitit").is_dir()
    rows, _ = summary_rows(sweep, capsys)
    assert [(r["fault"], r["status"]) for r in rows] == [("none", "ok"), ("inf_loss", "stopped")]
    assert "exceed guard.max_consecutive_skips=1" in rows[1]["note"]


def test_summary_of_a_folder_without_jobs_is_an_error(tmp_path, capsys):
    assert summarize_sweep.main([str(tmp_path)]) == 2
    assert "no job directory" in capsys.readouterr().err


def test_launcher_and_search_configs_compose():
    needs("hydra_submitit_launcher")
    needs("hydra_optuna_sweeper")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        slurm = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
        search = compose("config", overrides=["hparams_search=optuna"], return_hydra_config=True)
    assert slurm.hydra.launcher._target_.endswith("SlurmLauncher") and slurm.hydra.launcher.gpus_per_node == 1
    assert search.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert search.hydra.sweeper.direction == "maximize" and search.optimize_metric == "best_valid_exprate"
