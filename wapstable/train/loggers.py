"""Where a run's scalars go: TensorBoard, a CSV file, MLflow, Weights & Biases, or several at once (`logger=`).

The trainer and the gradient statistics report scalars by tag (`train/loss`) and step. `Loggers` gathers one step's
scalars and hands every backend the same dict once per step, so each backend holds the same numbers under the same
names, and a CSV row holds a whole step. Histograms, attention images and text go to TensorBoard only. MLflow and
wandb are imported only when chosen, from the optional extra (`pip install 'wapstable[loggers]'`).

Each logger is built from its config's `_target_` (conf/logger/NAME.yaml names the class and its options), so a
logger of one's own is one class and one yaml, in the package or anywhere on the Python path:

    class MyLogger:                       # the RunLogger protocol below
        @dataclass
        class Options:                    # its keys, typed: a wrong value is refused before the run starts
            path: str = "mine.txt"
        requires = ()                     # modules it needs beyond the base install (a missing one: one sentence)
        def __init__(self, run: LoggerRun, path: str): ...
        def log(self, scalars, step): ...
        def flush(self): ...
        def close(self, finished=True): ...

    # conf/logger/mine.yaml (or a folder of the user's on hydra.searchpath)
    mine:
      _target_: mypackage.MyLogger
      path: mine.txt
"""

import csv
import importlib
import math
import os
import time
from dataclasses import asdict, dataclass, is_dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from wapstable.errors import UserError
from wapstable.targets import import_class, typed_options

# Every scalar a run logs, in the CSV's column order. Steps count the optimizer steps done (1-based): the row of
# step N holds the N-th training step, its gradient statistics, and the evaluation and rollback that followed it.
SCALARS = [
    "train/loss",
    "train/grad_norm",  # global norm before clipping, in clip's norm type
    "train/lr",
    "train/clipped",  # 1 when clipping changed the gradients
    "train/skipped",  # 1 when the guard skipped the step
    "stats/grad_norm_clipped",  # on stats.every steps: the norm after clipping
    "stats/clip_threshold",
    "stats/update_ratio",  # ||W_after - W_before|| / ||W_after||
    "stats/param_norm",
    "stats/nonfinite_grads",
    "valid/exprate",  # at each evaluation, in %
    "valid/wer",
    "valid/loss",
    "guard/rollback",  # the number of rollbacks so far, at each rollback
    "test/exprate",  # at the end: the best checkpoint, beam decode.final_beam_size
]
# Logged only by a run with the attention guide on (model.attention.guide.weight > 0): its unweighted loss and its
# weight at the step. Apart from SCALARS so that the CSV of a run without the guide keeps its columns.
GUIDE_SCALARS = ["train/guide", "train/guide_weight"]
# Logged only by a run with the symbol map on (model.symbol_map > 0): its unweighted loss.
SYMBOL_MAP_SCALARS = ["train/symbol_map"]


@dataclass(frozen=True)
class LoggerRun:
    """What every logger is given besides its own options: the run directory, the run's name (its directory's
    last two parts: DATE/TIME, or TIME/JOB in a sweep), the run's resolved config as a dict (MLflow's params,
    wandb's config), and the tags it will be sent (SCALARS and the heads' own)."""

    run_dir: Path
    name: str
    config: dict
    tags: list[str]


class RunLogger(Protocol):
    """A logger: built as `cls(run, **options)` from its config's `_target_`, handed one step's scalars at a time."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self, finished: bool = True) -> None: ...


def chosen(cfg_logger) -> list[str]:
    """The names of the loggers `cfg.logger` turns on, in the config's order."""
    return [name for name, opts in cfg_logger.items() if opts is not None]


def logger_class(name: str, opts) -> type:
    """The class `logger.NAME._target_` names, with its options checked against its `Options` dataclass and the
    modules it `requires` importable; a UserError in one sentence otherwise."""
    target = opts.get("_target_") if hasattr(opts, "get") else None
    if not target:
        raise UserError(
            f"logger.{name} names no class: give it a _target_ (a logger class, as conf/logger/csv.yaml does), or "
            f"drop it from logger="
        )
    cls = import_class(target, f"logger.{name}", "name a logger class on the Python path")
    for module in getattr(cls, "requires", ()):
        try:
            importlib.import_module(module)
        except ImportError:
            raise UserError(
                f"logger={name} needs the {module} package, which is not installed; install it with "
                f"pip install 'wapstable[loggers]', or choose another logger (logger=[tensorboard,csv])"
            ) from None
    options(name, cls, opts)
    return cls


def options(name: str, cls: type, opts) -> dict[str, Any]:
    """`opts` without `_target_`, checked against `cls.Options` (types, choices, unknown keys) when it has one."""
    given = {k: v for k, v in OmegaConf.to_container(OmegaConf.create(dict(opts))).items() if k != "_target_"}
    schema = getattr(cls, "Options", None)
    if schema is None or not is_dataclass(schema):
        return given
    typed = typed_options(schema, given, f"logger.{name}", f"conf/logger/{name}.yaml")
    return {k: (str(v) if isinstance(v, StrEnum) else v) for k, v in asdict(typed).items()}


def check_logger_config(cfg_logger) -> None:
    """Fail before training on a logger whose class, package or option is wrong."""
    for name in chosen(cfg_logger):
        logger_class(name, cfg_logger[name])


class TensorBoardLogger:
    """Event files for `tensorboard --logdir`; its `writer` also takes histograms, images and text."""

    @dataclass
    class Options:
        dir: str = "tb"  # relative to the run directory

    requires = ()

    def __init__(self, run: LoggerRun, dir: str = "tb"):  # noqa: A002  (the config key's name)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run.run_dir) / dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, finished: bool = True) -> None:
        self.writer.close()


class CsvLogger:
    """One row per logged step: `step` and one column per tag of SCALARS, empty where not logged that step.

    A resumed run appends to the same file; a step it redoes appears again (the last row of a step is the one that
    counts: `drop_duplicates("step", keep="last")` in pandas).
    """

    @dataclass
    class Options:
        file: str = "metrics.csv"  # relative to the run directory

    requires = ()

    def __init__(self, run: LoggerRun, file: str = "metrics.csv"):
        self.path = Path(run.run_dir) / file
        self.columns = ["step", *run.tags]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file() and self.path.stat().st_size > 0:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), [])
            if header != self.columns:
                raise UserError(
                    f"{self.path} has other columns than this version writes; move it away, or set "
                    "logger.csv.file=OTHER.csv"
                )
            new = False
        else:
            new = True
        # Line-buffered: each row reaches the file when it is written, so a crash loses nothing.
        self.file = open(self.path, "a", newline="", buffering=1)
        self.writer = csv.writer(self.file)
        if new:
            self.writer.writerow(self.columns)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.writer.writerow([step, *(scalars.get(c, "") for c in self.columns[1:])])

    def flush(self) -> None:
        self.file.flush()

    def close(self, finished: bool = True) -> None:
        self.file.close()


class MlflowLogger:
    """An MLflow run: metrics by step, the run's config as params.

    With the default file store in the run directory (`tracking_uri` None), a resumed run continues the MLflow run
    already there. MLflow 3 refuses file stores unless MLFLOW_ALLOW_FILE_STORE is set; it is set for this process.
    """

    @dataclass
    class Options:
        tracking_uri: str | None = None  # None = a file store in the run directory's mlruns/
        experiment: str = "wapstable"
        run_name: str | None = None  # None = the run directory's name

    requires = ("mlflow",)

    def __init__(
        self, run: LoggerRun, tracking_uri: str | None = None, experiment: str = "wapstable", run_name=None
    ):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        run_dir, run_name, params = run.run_dir, run_name or run.name, flatten(run.config)

        own_store = tracking_uri is None
        if own_store:
            tracking_uri = (Path(run_dir).resolve() / "mlruns").as_uri()
        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        earlier = self.client.search_runs([experiment_id], max_results=1) if own_store else []
        if earlier:  # a resumed run: params are immutable in MLflow, and already logged
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            items = [Param(k, v[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # the most params one log_batch call takes
                self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def flush(self) -> None:
        pass  # every log_batch is written when it returns

    def close(self, finished: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")


WandbMode = StrEnum("WandbMode", "offline online disabled")


class WandbLogger:
    """A Weights & Biases run under `run_dir/wandb/` (offline by default: `wandb sync` uploads it later)."""

    @dataclass
    class Options:
        project: str = "wapstable"
        mode: WandbMode = WandbMode.offline
        entity: str | None = None
        name: str | None = None  # None = the run directory's name

    requires = ("wandb",)

    def __init__(
        self, run: LoggerRun, project="wapstable", mode="offline", entity: str | None = None, name=None
    ):
        import wandb

        self.run = wandb.init(
            project=project,
            entity=entity,
            name=name or run.name,
            mode=mode,
            dir=str(run.run_dir),
            config=run.config,
            # console="off": wandb leaves stdout and stderr alone (the progress bar and Hydra's log stay as they are)
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        pass  # wandb writes in its own process

    def close(self, finished: bool = True) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class Loggers:
    """The chosen backends behind one `scalar(tag, value, step)`; `tensorboard` is the SummaryWriter or None.

    Scalars are gathered per step and handed to every backend when a new step begins (and on flush and close), so
    they are logged in step order: callers give non-decreasing steps. Non-finite values are left out everywhere (a
    skipped step's NaN loss): `train/skipped` says what happened.
    """

    def __init__(self, backends: list, tags: list[str] = SCALARS):
        self.backends = backends
        self.tags = set(tags)
        self.tensorboard = next((b.writer for b in backends if isinstance(b, TensorBoardLogger)), None)
        self.step: int | None = None
        self.pending: dict[str, float] = {}

    def scalar(self, tag: str, value: float | None, step: int) -> None:
        assert tag in self.tags, f"{tag} is not in loggers.SCALARS"
        if value is None or not math.isfinite(value):
            return
        if step != self.step:
            self.emit()
            self.step = step
        self.pending[tag] = float(value)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_text(tag, text, step)

    def emit(self) -> None:
        if self.pending:
            for backend in self.backends:
                backend.log(self.pending, self.step)
        self.pending = {}

    def flush(self) -> None:
        self.emit()
        for backend in self.backends:
            backend.flush()

    def close(self, finished: bool = True) -> None:
        """Write what is pending and close every backend; `finished` False marks the run failed where it can."""
        self.emit()
        for backend in self.backends:
            backend.close(finished)
        self.backends = []
        self.tensorboard = None


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"model": {"dim": 8}} -> {"model.dim": "8"}: a nested config as MLflow's flat string params."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)
    return out


def build_loggers(cfg_logger, run_dir: Path, config: dict, extra: list[str] = ()) -> Loggers:
    """The loggers `cfg.logger` names, each built from its `_target_` with its options, writing under `run_dir`;
    `config` (the run's resolved config as a dict) goes to MLflow's params and wandb's config; `extra` tags are
    logged beside SCALARS (GUIDE_SCALARS, SYMBOL_MAP_SCALARS)."""
    tags = [*SCALARS, *extra]
    run_dir = Path(run_dir)
    # outputs/DATE/TIME -> DATE/TIME; in a sweep, TIME/JOB
    run = LoggerRun(run_dir, f"{run_dir.parent.name}/{run_dir.name}", config, tags)
    backends = []
    for name in chosen(cfg_logger):
        cls = logger_class(name, cfg_logger[name])
        backends.append(cls(run, **options(name, cls, cfg_logger[name])))
    return Loggers(backends, tags)
