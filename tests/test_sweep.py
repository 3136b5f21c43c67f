"""Sweeps: Hydra multirun (basic, joblib and submitit_local launchers), the Optuna search and its pruning, and the
sweep summary."""

import csv
import importlib.util
import json
import os
import sys

import pytest
import yaml
from conftest import ROOT, TINY, python_run, require_extra
from hydra import compose, initialize_config_dir

spec = importlib.util.spec_from_file_location("summarize_sweep", ROOT / "scripts" / "summarize_sweep.py")
summarize_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize_sweep)


def needs(plugin: str):
    return require_extra(f"hydra_plugins.{plugin}", "sweep")


def needs_optuna():
    """The Optuna sweeper (hydra_plugins/wapstable_optuna) ships with wapstable; Optuna is in the sweep extra."""
    return require_extra("optuna", "sweep")


def trial_states(storage: str, study: str = "wapstable") -> list[str]:
    """The states of a study's trials, by trial number, as the sweeper told them to the storage."""
    optuna = needs_optuna()
    return [t.state.name for t in optuna.load_study(study_name=study, storage=storage).trials]


def multirun(args, sweep_dir, cache_dir, timeout=600):
    """`python train.py -m` with tiny settings into `sweep_dir`; returns the CompletedProcess."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY, f"hydra.sweep.dir={sweep_dir}", *args]
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir)}
    return python_run(cmd, env=env, timeout=timeout)


def explain(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def summary_rows(sweep_dir, capsys) -> tuple[list[dict], str]:
    assert summarize_sweep.main([str(sweep_dir)]) == 0
    printed = capsys.readouterr().out
    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f)), printed


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
        choices = yaml.safe_load((job / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["choices"]
        combos.add((choices["clip"], cfg["optim"]["lr"]))
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
    # trainer.threads=auto shares the cores between the two: each job gets half of them.
    needs("hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    args = ["clip.max_norm=1,-1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "trainer.threads=auto"]
    proc = multirun(args, sweep, cache_dir)
    assert proc.returncode != 0  # Hydra reports the failure once every job has run
    assert (sweep / "0" / "metrics.json").is_file() and not (sweep / "1" / "metrics.json").exists()
    assert f"; {max(1, len(os.sched_getaffinity(0)) // 2)} threads" in (sweep / "0" / "train.log").read_text()
    rows, printed = summary_rows(sweep, capsys)
    assert [(r["clip.max_norm"], r["status"]) for r in rows] == [("1", "ok"), ("-1", "failed")]
    assert "clip.max_norm=-1.0 must be positive" in rows[1]["note"]
    assert "1 failed" in printed and "failed" in (sweep / "summary.md").read_text()
    assert (sweep / "summary.png").is_file()


def test_optuna_search_returns_the_configured_metric_and_continues_a_study(tmp_path, cache_dir, capsys):
    # Two trials; the metric is the wall time (minimised), which differs between trials where ExpRate is 0 for both,
    # so the best value shows that train() returned the configured metric.
    needs_optuna()
    sweep = tmp_path / "sweep"
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = [
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "optimize_metric=wall_time_s",
        "hydra.sweeper.direction=minimize",
        f"hydra.sweeper.storage='{storage}'",
    ]
    proc = multirun(args, sweep, cache_dir)
    assert proc.returncode == 0, explain(proc)
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(result["best_params"]) == {"optim.lr", "clip", "clip.max_norm", "clip.value"}
    times = [json.loads((sweep / j / "metrics.json").read_text())["wall_time_s"] for j in ("0", "1")]
    assert result["best_value"] == min(times)
    assert result["trials"] == {"complete": 2, "pruned": 0, "fail": 0}
    rows, printed = summary_rows(sweep, capsys)
    assert len(rows) == 2 and "Optuna best" in printed

    # A later sweep on the same storage continues the study: its trial is the study's third, in job directory 2.
    later = tmp_path / "later"
    proc = multirun([*args[:1], "hydra.sweeper.n_trials=1", *args[2:]], later, cache_dir)
    assert proc.returncode == 0, explain(proc)
    assert trial_states(storage) == ["COMPLETE"] * 3
    assert (later / "2" / "metrics.json").is_file() and not (later / "0").exists()


@pytest.mark.slow
def test_optuna_grid_runs_every_clip_mode(tmp_path, cache_dir, capsys):
    # The search space's clip choices through train.py -m, `inf` included: Hydra reads a bare `inf` as a float and
    # refused `clip=inf` as a config group option, which ended the sweep of the old sweeper at the first draw of it.
    needs_optuna()
    sweep = tmp_path / "sweep"
    args = [
        "hparams_search=optuna",
        "hydra/sweeper/sampler=grid",
        # the grid takes choices only: the interval params are fixed on the command line, the clip thresholds with
        # ++ (each clip option has its own keys; each trial is passed the one its option has)
        "optim.lr=1.0",
        "++clip.max_norm=1.0",
        "++clip.value=1.0",
    ]
    proc = multirun(args, sweep, cache_dir)
    assert proc.returncode == 0, explain(proc)
    modes = [
        yaml.safe_load((sweep / j / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["choices"][
            "clip"
        ]
        for j in "0123"
    ]
    assert sorted(modes) == ["inf", "none", "norm", "value"]
    # each trial got the thresholds its rule has, and no other
    for j in "0123":
        clip = yaml.safe_load((sweep / j / ".hydra" / "config.yaml").read_text())["clip"]
        mode = modes[int(j)]
        assert (
            set(clip) - {"_target_"}
            == {"none": set(), "norm": {"max_norm", "norm_type"}, "inf": {"max_norm"}, "value": {"value"}}[
                mode
            ]
        )
    assert all((sweep / j / "metrics.json").is_file() for j in "0123") and not (sweep / "4").exists()
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["trials"] == {"complete": 4, "pruned": 0, "fail": 0}
    assert trial_states(f"sqlite:///{sweep / 'optuna.db'}") == ["COMPLETE"] * 4
    rows, _ = summary_rows(sweep, capsys)
    assert sorted(r["clip"] for r in rows) == [
        "inf",
        "none",
        "norm",
        "value",
    ]  # no quotes left from clip='inf'


@pytest.mark.slow  # make test-all; make test keeps the Optuna search itself
def test_optuna_prunes_and_records_stopped_trials(tmp_path, cache_dir, capsys):
    # Every (max_steps, fault) pair once. The threshold pruner gives up on a valid ExpRate below 50% (every tiny run's):
    # the 6-step trial is pruned at its first evaluation, step 2; the 2-step trial's only evaluation is its last, so
    # it completes. The inf_loss trials exhaust their skip budget (the guard stops them, exit 3 on their own): failed,
    # and the search goes on.
    needs_optuna()
    sweep = tmp_path / "sweep"
    args = [
        "hparams_search=optuna",
        "hydra/sweeper/sampler=grid",
        "hydra/sweeper/pruner=threshold",
        "hydra.sweeper.pruner.lower=50",
        "trainer.max_steps=choice(2,6)",
        "fault=choice(none,inf_loss)",
        "trainer.eval_every=2",
        "fault.step=0",
        "fault.steps=10",
        "guard.max_consecutive_skips=1",
        "optim.lr=1.0",
        "clip=norm",
        "clip.max_norm=1.0",
        "++clip.value=1.0",  # fixes the search space's interval; clip=norm has no such key, so no trial is passed it
    ]
    proc = multirun(args, sweep, cache_dir)
    assert proc.returncode == 0, explain(proc)
    by_trial = {}
    for job in "0123":
        overrides = yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        by_trial[int(job)] = (
            next(o.split("=")[1] for o in overrides if o.startswith("trainer.max_steps=")),
            next(o.split("=")[1] for o in overrides if o.startswith("fault=")),
        )
    states = dict(zip(range(4), trial_states(f"sqlite:///{sweep / 'optuna.db'}")))
    assert {by_trial[n]: state for n, state in states.items()} == {
        ("2", "none"): "COMPLETE",
        ("6", "none"): "PRUNED",
        ("2", "inf_loss"): "FAIL",
        ("6", "inf_loss"): "FAIL",
    }
    pruned_job = sweep / str(next(n for n, s in states.items() if s == "PRUNED"))
    metrics = json.loads((pruned_job / "metrics.json").read_text())
    assert metrics["pruned"] is True and metrics["steps"] == 2 and "test_exprate" not in metrics
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["trials"] == {"complete": 1, "pruned": 1, "fail": 2}

    rows, printed = summary_rows(sweep, capsys)
    status = {(r["trainer.max_steps"], r["fault"]): r["status"] for r in rows}
    assert status == {
        ("2", "none"): "ok",
        ("6", "none"): "pruned",
        ("2", "inf_loss"): "stopped",
        ("6", "inf_loss"): "stopped",
    }
    assert "2 failed or stopped, 1 pruned" in printed
    assert "| pruned |" in (sweep / "summary.md").read_text()


def test_a_trial_reports_each_evaluation_and_the_median_pruner_stops_a_poor_one(tmp_path):
    # The hook the trainer calls at each evaluation, fed as the sweeper feeds it: through the environment and the
    # study's storage. Two finished trials had ExpRate 40 and 60 at step 100 (median 50).
    optuna = needs_optuna()
    from wapstable.train.sweep import TRIAL_ENV, pruning_callback, reported_key, reported_value

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    for value in (40.0, 60.0):
        done = study.ask()
        done.report(value, 100)
        study.tell(done, value)
    pruner = {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 2, "n_warmup_steps": 0}

    def hook(metric="best_valid_exprate"):
        trial = study.ask()
        env = {
            TRIAL_ENV: json.dumps(
                {
                    "storage": storage,
                    "study": "s",
                    "pruner": pruner,
                    "trial_id": trial._trial_id,
                    "trial": trial.number,
                }
            )
        }
        return trial, pruning_callback(metric, env)

    poor, on_eval = hook()
    assert on_eval({"step": 100, "exprate": 10.0, "wer": 90.0, "loss": 3.0}) is True
    good, on_eval = hook()
    assert on_eval({"step": 100, "exprate": 70.0, "wer": 20.0, "loss": 1.0}) is False
    stored = {t.number: t.intermediate_values for t in study.get_trials()}
    assert stored[poor.number] == {100: pytest.approx(10.0 - 3e-6)}
    assert stored[good.number] == {100: pytest.approx(70.0 - 1e-6)}
    # Early on every trial reads 0 %: the valid loss breaks the tie, so a trial that fits worse is still pruned.
    tied = optuna.create_study(study_name="tied", storage=storage, direction="maximize")
    for loss in (2.0, 4.0):
        done = tied.ask()
        done.report(reported_value({"exprate": 0.0, "loss": loss}, "exprate"), 100)
        tied.tell(done, 0.0)
    study = tied
    info = {"storage": storage, "study": "tied", "pruner": pruner}
    worse, better = study.ask(), study.ask()
    for trial, loss, pruned in ((worse, 5.0, True), (better, 1.0, False)):
        env = {TRIAL_ENV: json.dumps({**info, "trial_id": trial._trial_id, "trial": trial.number})}
        assert (
            pruning_callback("best_valid_exprate", env)({"step": 100, "exprate": 0.0, "loss": loss}) is pruned
        )
    # A metric with no validation figure in the study's direction (wall time, maximised) is not pruned on.
    assert hook("wall_time_s")[1] is None
    assert pruning_callback("best_valid_exprate", {}) is None  # outside a sweep
    assert (
        reported_key("best_valid_exprate", True) == "exprate"
        and reported_key("final_valid_wer", False) == "wer"
    )
    assert reported_key("best_valid_exprate", False) is None


def test_sweep_overrides_parse_back_to_the_drawn_value():
    # A config group's options are strings, whatever the grammar makes of them; other values keep their type.
    needs_optuna()
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.wapstable_optuna._impl import distribution, override_text

    parser = OverridesParser.create()
    dist, texts = distribution(parser.parse_override("clip=choice(none, norm, value, inf)"), is_group=True)
    assert list(dist.choices) == ["none", "norm", "value", "inf"]
    assert texts == {"none": "none", "norm": "norm", "value": "value", "inf": "'inf'"}
    assert parser.parse_override(f"clip={texts['inf']}").value() == "inf"
    dist, texts = distribution(parser.parse_override("clip.max_norm=choice(1, 2.5, inf)"), is_group=False)
    assert list(dist.choices) == [1, 2.5, float("inf")] and texts[float("inf")] == "inf"
    lr, _ = distribution(parser.parse_override("optim.lr=tag(log, interval(3e-4, 1e-2))"), is_group=False)
    assert lr.log and (lr.low, lr.high) == (3e-4, 1e-2)
    values = [
        "inf",
        "1",
        "true",
        "null",
        "it's",
        "a b",
        '{"a":1}',
        "x\\'y\\",
        "a,b",
        3,
        0.003,
        float("inf"),
        True,
    ]
    for value in values:
        parsed = parser.parse_override(f"k={override_text(value)}").value()
        assert parsed == value and type(parsed) is type(value), value


@pytest.mark.slow  # each job a fresh process under submitit: 20 s; the launcher's config composes in the quick tests
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
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        slurm = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
        search = compose("config", overrides=["hparams_search=optuna"], return_hydra_config=True)
        no_pruning = compose(
            "config",
            overrides=["hparams_search=optuna", "hydra/sweeper/pruner=none"],
            return_hydra_config=True,
        )
    assert slurm.hydra.launcher._target_.endswith("SlurmLauncher") and slurm.hydra.launcher.gpus_per_node == 1
    sweeper = search.hydra.sweeper
    assert sweeper._target_.endswith("wapstable_optuna.optuna_sweeper.WapstableOptunaSweeper")
    assert sweeper.direction == "maximize" and search.optimize_metric == "best_valid_exprate"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed == 0
    assert sweeper.pruner._target_ == "optuna.pruners.MedianPruner" and sweeper.pruner.n_startup_trials == 5
    assert sweeper.params.clip == "choice(none, norm, value, inf)"
    assert no_pruning.hydra.sweeper.pruner._target_ == "optuna.pruners.NopPruner"


def test_the_command_line_wins_over_the_search_space_and_each_key_is_given_once():
    needs_optuna()
    from omegaconf import OmegaConf

    from hydra_plugins.wapstable_optuna._impl import OptunaSearch

    search = OptunaSearch(
        sampler=OmegaConf.create({"_target_": "optuna.samplers.TPESampler"}),
        pruner=OmegaConf.create({"_target_": "optuna.pruners.NopPruner"}),
        direction="maximize",
        study_name="s",
        storage=None,
        n_trials=2,
        n_jobs=1,
        params=OmegaConf.create({"optim.lr": "interval(0.1, 1.0)", "clip": "choice(none, inf)"}),
    )
    search.is_group = lambda key: key == "clip"
    # The tiny settings fix max_steps, then the test searches it; optim.lr is fixed over its params interval.
    space, texts, fixed = search.search_space(
        ["trainer.max_steps=3", "trainer.max_steps=choice(2,6)", "optim.lr=0.5"]
    )
    assert set(space) == {"clip", "trainer.max_steps"} and fixed == ["optim.lr=0.5"]
    assert texts["clip"]["inf"] == "'inf'" and list(space["trainer.max_steps"].choices) == [2, 6]
