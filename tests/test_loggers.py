"""The logger group: every logger gets the same scalars, read back from what each one wrote."""

import csv
import json
import os
import struct
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, refusal_in_process, require_extra, run_train
from omegaconf import OmegaConf

from wapstable.errors import UserError
from wapstable.train.loggers import SCALARS, CsvLogger, LoggerRun, Loggers, check_logger_config

# 14 steps with an lr spike that exhausts the skip budget at step 7 and rolls back: skipped steps, a rollback, two
# evaluations and the test evaluation, with gradient statistics on every step, so every scalar is logged.
ROLLBACK = [
    "fault=lr_spike",
    "fault.step=4",
    "trainer.max_steps=14",
    "trainer.eval_every=7",
    "trainer.checkpoint_every=10",
    "guard.max_consecutive_skips=2",
    "guard.snapshot_every=2",
    "guard.localize=false",
    "guard.on_budget_exhausted=rollback",
    "stats.every=1",
]


def read_csv(path) -> dict[str, dict[int, float]]:
    """metrics.csv as {tag: {step: value}}, as a user reads it with the csv module."""
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for tag, value in row.items():
                if tag != "step" and value != "":
                    out.setdefault(tag, {})[int(row["step"])] = float(value)
    return out


def read_tensorboard(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def read_mlflow(store) -> tuple[dict[str, dict[int, float]], object]:
    """The metrics of the one MLflow run in the file store `store`, and the run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("wapstable").experiment_id])
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    return {k: {m.step: m.value for m in ms} for k, ms in history.items()}, run


def wandb_records(path):
    """The records of an offline .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB-log blocks of
    32 KiB whose records (crc32, length, type) hold protobuf `Record`s, split over blocks when they are long."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a FIRST/MIDDLE/LAST chain
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def read_wandb(run_dir) -> dict[str, dict[int, float]]:
    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for tag, value in items.items():
                if not tag.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    out.setdefault(tag, {})[record.history.step.num] = float(value)
    return out


def test_every_logger_gets_the_same_scalars(tmp_path, cache_dir, monkeypatch):
    require_extra("mlflow", "loggers")
    require_extra("wandb", "loggers")
    run = tmp_path / "run"
    run_train([*ROLLBACK, "logger=[tensorboard,csv,mlflow,wandb]"], run, cache_dir)

    scalars = read_csv(run / "metrics.csv")
    assert set(scalars) == set(SCALARS)  # every scalar, rollbacks and ExpRate included
    assert sorted(scalars["train/skipped"]) == list(
        range(1, 15)
    )  # one row per step, 1-based as TensorBoard's
    skipped = {step for step, v in scalars["train/skipped"].items() if v == 1.0}
    assert skipped and set(scalars["train/loss"]) >= set(range(1, 15)) - skipped  # NaN losses are left out
    assert sorted(scalars["valid/exprate"]) == [7, 14] and list(scalars["test/exprate"]) == [14]
    assert scalars["guard/rollback"] == {8: 1.0}  # the rollback at the end of step 8 (index 7)
    assert set(scalars["stats/grad_norm_clipped"]) == set(range(1, 15)) - skipped  # a skip clips nothing

    with open(run / "metrics.csv", newline="") as f:
        assert next(csv.reader(f)) == ["step", *SCALARS]

    tensorboard = read_tensorboard(run / "tb")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow, mlflow_run = read_mlflow(run / "mlruns")
    wandb = read_wandb(run)
    for name, got in (("tensorboard", tensorboard), ("mlflow", mlflow), ("wandb", wandb)):
        assert set(got) == set(SCALARS), name
        for tag, values in scalars.items():
            assert got[tag] == pytest.approx(values, rel=1e-6), (name, tag)  # TensorBoard keeps float32
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["model.hidden_dim"] == "16"


def at(run_dir, tags=SCALARS) -> LoggerRun:
    return LoggerRun(run_dir, "a/run", {"seed": "0"}, list(tags))


def test_a_step_is_one_row_and_a_resumed_run_appends(tmp_path):
    path = tmp_path / "metrics.csv"
    loggers = Loggers([CsvLogger(at(tmp_path))])
    loggers.scalar("train/loss", 2.5, 1)
    loggers.scalar("stats/param_norm", 3.0, 1)
    loggers.scalar("train/loss", float("nan"), 2)  # a skipped step's loss: left out, the row still written
    loggers.scalar("train/skipped", 1.0, 2)
    loggers.close()
    loggers = Loggers([CsvLogger(at(tmp_path))])
    loggers.scalar("train/loss", 1.5, 3)
    loggers.close()
    assert read_csv(path) == {
        "train/loss": {1: 2.5, 3: 1.5},
        "stats/param_norm": {1: 3.0},
        "train/skipped": {2: 1.0},
    }
    assert path.read_text().count("step,") == 1  # one header

    path.write_text("step,loss\n1,2.0\n")  # another version's columns: refused, not appended to
    with pytest.raises(UserError, match="logger.csv.file"):
        CsvLogger(at(tmp_path))


def test_csv_alone_writes_no_tensorboard(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train(["logger=csv", "stats.every=1", "stats.histogram_every=1"], run, cache_dir)
    assert not (run / "tb").exists()
    scalars = read_csv(run / "metrics.csv")
    assert sorted(scalars["train/loss"]) == [1, 2, 3] and set(scalars["stats/param_norm"]) == {1, 2, 3}


def test_mlflow_resumes_the_run_in_its_run_directory(tmp_path, monkeypatch):
    require_extra("mlflow", "loggers")
    from wapstable.train.loggers import MlflowLogger

    first = MlflowLogger(at(tmp_path))
    first.log({"train/loss": 2.0}, 1)
    first.close(finished=False)
    second = MlflowLogger(at(tmp_path))
    second.log({"train/loss": 1.0}, 2)
    second.close()
    assert second.run_id == first.run_id
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    metrics, run = read_mlflow(tmp_path / "mlruns")
    assert metrics == {"train/loss": {1: 2.0, 2: 1.0}} and run.info.status == "FINISHED"


def test_logger_config_needs_only_its_packages():
    check_logger_config(OmegaConf.create({"csv": {"_target_": "wapstable.train.loggers.CsvLogger"}}))


def conf_loggers() -> list[str]:
    """The logger options as conf/ has them: one yaml each, its one key the logger's name."""
    names = sorted(p.stem for p in (ROOT / "wapstable" / "conf" / "logger").glob("*.yaml"))
    for name in names:
        assert list(OmegaConf.load(ROOT / "wapstable" / "conf" / "logger" / f"{name}.yaml")) == [name]
    return names


@pytest.mark.parametrize(
    "args, says",
    [
        (["logger.csv.file=7"], None),  # a number is a fine file name: accepted as the string "7"
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode: Invalid value 'sometimes'"),
        (["logger.csv._target_=wapstable.train.loggers.NoSuchLogger"], "logger.csv._target_="),
        (["logger.csv._target_=null"], "logger.csv names no class: give it a _target_"),
    ],
)
def test_each_logger_checks_its_own_options(tmp_path, args, says):
    """Each logger's options against its class's Options dataclass, and its _target_, before the run starts."""
    from conftest import compose_config

    require_extra("wandb", "loggers")
    cfg = compose_config(["logger=[csv,wandb]", *args])
    if says is None:
        check_logger_config(cfg.logger)
        return
    with pytest.raises(UserError) as refused:
        check_logger_config(cfg.logger)
    assert says in str(refused.value) and len(str(refused.value).splitlines()) == 1


MY_LOGGER = """
from dataclasses import dataclass
from pathlib import Path


class LineLogger:
    \"\"\"A user's own logger: one line per step, `step tag=value ...`.\"\"\"

    @dataclass
    class Options:
        file: str = "lines.txt"
        every: int = 1

    requires = ()

    def __init__(self, run, file="lines.txt", every=1):
        self.every = every
        self.out = open(Path(run.run_dir) / file, "a")

    def log(self, scalars, step):
        if step % self.every == 0:
            self.out.write(f"{step} " + " ".join(f"{k}={v:g}" for k, v in sorted(scalars.items())) + "\\n")

    def flush(self):
        self.out.flush()

    def close(self, finished=True):
        self.out.close()
"""


def line_steps(path) -> list[int]:
    return [int(line.split()[0]) for line in path.read_text().splitlines()]


@pytest.mark.slow  # make test-all (fresh processes outside the package; make test stays under 5 minutes)
def test_a_logger_of_ones_own_is_one_class_and_one_yaml(tmp_path, cache_dir):
    """A class outside the package named by its _target_, and a yaml in a config folder of the user's on
    hydra.searchpath: nothing of the package edited. Its options are checked as the package's loggers' are."""
    code = tmp_path / "mine"
    code.mkdir()
    (code / "line_logger.py").write_text(MY_LOGGER)
    conf = tmp_path / "myconf" / "logger"
    conf.mkdir(parents=True)
    (conf / "lines.yaml").write_text(
        "lines:\n  _target_: line_logger.LineLogger\n  file: lines.txt\n  every: 1\n"
    )
    env = {**os.environ, "PYTHONPATH": str(code), "WAPSTABLE_CACHE": str(cache_dir)}
    base = [sys.executable, str(ROOT / "train.py"), *TINY, f"hydra.searchpath=[file://{conf.parent}]"]
    run = tmp_path / "run"
    cmd = [*base, "logger=[csv,lines]", "logger.lines.every=2", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert line_steps(run / "lines.txt") == [2]  # its own option, from the command line
    assert "train/loss=" in (run / "lines.txt").read_text()
    assert read_csv(run / "metrics.csv")["train/loss"].keys() == {1, 2, 3}  # beside the package's own

    bad = tmp_path / "bad"
    cmd = [*base, "logger=[lines]", "logger.lines.every=often", f"hydra.run.dir={bad}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [x for x in (proc.stdout + proc.stderr).splitlines() if "ERROR" in x]
    assert "logger.lines.every:" in line and "often" in line
    assert not (bad / "lines.txt").exists() and not (bad / "checkpoints").exists()


@pytest.mark.slow  # make test-all
def test_a_checkpoint_from_before_the_targets_resumes_with_its_loggers(tmp_path, cache_dir):
    """A checkpoint whose logger config has no _target_ (and None for the loggers it did not choose), as every
    checkpoint before the loggers were built from _target_ has: resumed, it logs to the same loggers."""
    from wapstable.checkpoint import load_checkpoint, save_checkpoint

    run = tmp_path / "run"
    run_train(["logger=csv", "trainer.max_steps=2", "trainer.checkpoint_every=2"], run, cache_dir)
    last = run / "checkpoints" / "last.pt"
    state = load_checkpoint(last)
    assert state["config"]["logger"] == {
        "csv": {"_target_": "wapstable.train.loggers.CsvLogger", "file": "metrics.csv"}
    }
    state["config"]["logger"] = {
        "tensorboard": None,
        "csv": {"file": "metrics.csv"},
        "mlflow": None,
        "wandb": None,
    }
    save_checkpoint(state, last)
    run_train(["resume=auto", "trainer.max_steps=4"], run, cache_dir)
    assert sorted(read_csv(run / "metrics.csv")["train/loss"]) == [1, 2, 3, 4]
    assert not (run / "tb").exists()


def test_the_logger_options_are_the_conf_folder_s():
    """Every yaml of conf/logger/ names its logger's class, whose Options hold the yaml's keys and defaults."""
    from hydra.utils import get_class

    names = conf_loggers()
    assert {"tensorboard", "csv", "mlflow", "wandb"} <= set(names)
    for name in names:
        opts = OmegaConf.to_container(
            OmegaConf.load(ROOT / "wapstable" / "conf" / "logger" / f"{name}.yaml")[name]
        )
        cls = get_class(opts.pop("_target_"))
        defaults = {
            k: str(v) if v is not None and not isinstance(v, str) else v
            for k, v in vars(cls.Options()).items()
        }
        assert {
            k: str(v) if v is not None and not isinstance(v, str) else v for k, v in opts.items()
        } == defaults


@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_missing_package_is_refused_in_one_sentence(tmp_path, cache_dir, package, monkeypatch):
    """The refusal, in this process: the package's import fails as on a machine without the extra (the command:
    test_missing_package_is_one_sentence_and_exit_2)."""
    monkeypatch.setitem(sys.modules, package, None)  # import_module(package) now raises ImportError
    message = refusal_in_process([f"logger=[csv,{package}]"], tmp_path / "run", cache_dir)
    assert f"logger={package} needs the {package} package" in message and "wapstable[loggers]" in message


@pytest.mark.slow  # make test-all; make test has the refusal in process (above)
@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_missing_package_is_one_sentence_and_exit_2(tmp_path, cache_dir, package):
    """As on a machine without the extra: a package that fails to import shadows the installed one."""
    fake = tmp_path / "site" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError('No module named {package}')\n")
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(fake.parent), "WAPSTABLE_CACHE": str(cache_dir)}
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, f"logger=[csv,{package}]", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [x for x in (proc.stdout + proc.stderr).splitlines() if "ERROR" in x]
    assert f"logger={package} needs the {package} package" in line and "wapstable[loggers]" in line
    assert not (run / "checkpoints").exists() and not (run / "metrics.csv").exists()
