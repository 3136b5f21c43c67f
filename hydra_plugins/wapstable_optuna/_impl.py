"""The Optuna search behind `hydra/sweeper=wapstable_optuna` (Optuna >= 4).

A batch of `n_jobs` trials at a time: ask the study for each trial's parameters, turn them into Hydra overrides,
launch the batch with the configured launcher (basic, joblib, submitit), tell the study how each ended:
- COMPLETE with the value the task returned (`train()`'s `optimize_metric`);
- PRUNED when the task raised TrialPruned: the trainer reported its valid ExpRate at each evaluation and the
  pruner stopped it (see `wapstable/train/sweep.py`);
- FAIL when it raised anything else (a config the trial's parameters make invalid, a run the guard stopped) or
  returned no number. A failed trial never ends the search.

Each trial's job gets `hydra.job.env_set.WAPSTABLE_OPTUNA_TRIAL`: the storage URL, study name, trial id and pruner,
as JSON. The trainer reaches its trial through that storage, so pruning works the same in the sweep's process, in a
joblib worker or in a submitit job; that is why the storage is always a database (an SQLite file in the sweep
directory unless `storage` names one).

Overrides are written so that Hydra parses them back to the value drawn: a config group's option is a string even
where the grammar reads it as something else (`clip=inf` would be the float inf, and Hydra would refuse it).
"""

import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from wapstable.errors import TrialPruned
from wapstable.train.sweep import TRIAL_ENV

log = logging.getLogger(__name__)
PARSER = OverridesParser.create()


def schema_keys(group: str) -> set[str]:
    """The keys the typed schema (wapstable.config.Config) gives config group `group` whatever its option: a
    dataclass's fields; none for a group typed as a dict, whose options each bring their own keys."""
    from wapstable.config import Config

    field = next((f for f in dataclasses.fields(Config) if f.name == group), None)
    default = field.default_factory() if field is not None and callable(field.default_factory) else None
    return {f.name for f in dataclasses.fields(default)} if dataclasses.is_dataclass(default) else set()


def override_text(value: Any) -> str:
    """`value` as Hydra's override grammar writes it, so that it parses back to the same value and type."""
    if isinstance(value, str):
        try:
            parsed = PARSER.parse_override(f"k={value}")
            same = (
                not parsed.is_sweep_override() and parsed.value() == value and isinstance(parsed.value(), str)
            )
        except Exception:  # HydraException and the grammar's own errors: quote it
            same = False
        if same:
            return value
        # Hydra's quoted strings: a quote is escaped, and so are the backslashes before a quote or at the end.
        escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
        return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped) + "'"
    return Transformer.str(value)


def distribution(override: Override, is_group: bool) -> tuple[BaseDistribution, dict]:
    """The Optuna distribution of a sweep override, and for a categorical one the override text of each choice.

    `choice(...)` and `range(...)` are categorical (a config group's options always as strings: `inf` is a clip
    mode, not a float); `interval(lo, hi)` is an int or float range, `tag(log, interval(...))` on a log scale.
    """
    if override.is_choice_sweep() or override.is_range_sweep():
        texts = {}
        for value in override.sweep_iterator():
            # a list or dict: the choice is its override text
            if not isinstance(value, bool | int | float | str):
                value = Transformer.str(value)
                texts[value] = value
            else:
                if is_group and not isinstance(value, str):
                    value = Transformer.str(value)  # the float inf -> the option "inf"
                texts[value] = override_text(value)
        return CategoricalDistribution(list(texts)), texts
    if override.is_interval_sweep():
        interval = override.value()
        log_scale = "log" in interval.tags
        if isinstance(interval.start, int) and isinstance(interval.end, int):
            return IntDistribution(interval.start, interval.end, log=log_scale), {}
        return FloatDistribution(float(interval.start), float(interval.end), log=log_scale), {}
    raise ValueError(f"{override.input_line}: the Optuna sweeper takes choice(), range() and interval()")


def suggest(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log, step=dist.step)
    return trial.suggest_float(name, dist.low, dist.high, log=dist.log, step=dist.step)


def absolute_storage(url: str) -> str:
    """An SQLite URL with an absolute path: trials in other processes and folders must find the same file."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and ":memory:" not in url:
        return prefix + str(Path(url[len(prefix) :]).resolve())
    return url


def outcome(ret: JobReturn) -> tuple[TrialState, float | None, str]:
    """How a trial's job ended: (state for the study, value when complete, a note for the log)."""
    if ret.status != JobStatus.COMPLETED:
        error = ret._return_value  # the exception the task raised (JobReturn.return_value would re-raise it)
        if isinstance(error, TrialPruned | optuna.TrialPruned):
            return TrialState.PRUNED, None, str(error)
        return TrialState.FAIL, None, f"{type(error).__name__}: {error}"
    try:
        value = float(ret._return_value)
    except (TypeError, ValueError):
        return TrialState.FAIL, None, f"the task returned {ret._return_value!r}, not a number"
    if not math.isfinite(value):
        return TrialState.FAIL, None, f"the task returned {value}"
    return TrialState.COMPLETE, value, ""


class OptunaSearch:
    def __init__(
        self,
        sampler: DictConfig,
        pruner: DictConfig,
        direction: str,
        study_name: str,
        storage: str | None,
        n_trials: int,
        n_jobs: int,
        params: DictConfig | None,
    ) -> None:
        if direction not in ("maximize", "minimize"):
            raise ValueError(f"hydra.sweeper.direction={direction!r} is unknown; use maximize or minimize")
        if n_trials < 1 or n_jobs < 1:
            raise ValueError("hydra.sweeper.n_trials and hydra.sweeper.n_jobs must be >= 1")
        self.sampler_cfg = OmegaConf.to_container(sampler, resolve=True)
        self.pruner_cfg = OmegaConf.to_container(pruner, resolve=True)
        self.direction, self.study_name, self.storage = direction, study_name, storage
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.params = {str(k): str(v) for k, v in (params or {}).items()}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def is_group(self, key: str) -> bool:
        """Whether `key=value` chooses a config group's option (`clip=inf`), by the rule Hydra itself follows."""
        return bool(self.hydra_context.config_loader.get_group_options(key.lstrip("+~")))

    def search_space(self, arguments: list[str]) -> tuple[dict, dict, list[str]]:
        """(distributions, override texts of categorical choices, fixed overrides) of the params and the command
        line. Each key once, the last word winning: the command line over the params, a later override over an
        earlier one (a plain value there fixes a searched key)."""
        last = {}
        for override in PARSER.parse_overrides([f"{k}={v}" for k, v in self.params.items()] + arguments):
            key = override.get_key_element().lstrip("+~")  # ++clip.value=1 fixes the searched clip.value
            last.pop(key, None)  # re-inserted: keeps the command line's order
            last[key] = override
        space, texts, fixed = {}, {}, []
        for key, override in last.items():
            if not override.is_sweep_override():
                fixed.append(override.input_line)
                continue
            space[key], choice_texts = distribution(override, self.is_group(key))
            if isinstance(space[key], CategoricalDistribution):
                texts[key] = choice_texts
        return space, texts, fixed

    def make_sampler(self, space: dict) -> tuple[optuna.samplers.BaseSampler, int]:
        """The configured sampler, and the number of trials to run (a grid's size at most)."""
        cfg = {k: v for k, v in self.sampler_cfg.items() if k != "_partial_"}
        if not cfg["_target_"].endswith("GridSampler"):
            return instantiate(cfg), self.n_trials
        grid = {}
        for key, dist in space.items():
            if not isinstance(dist, CategoricalDistribution):
                raise ValueError(
                    f"the grid sampler needs choice(...) or range(...) for every searched key, and {key} is an "
                    f"interval; give it choice(...) or a fixed value ({key}=VALUE)"
                )
            grid[key] = list(dist.choices)
        size = math.prod(len(v) for v in grid.values())
        return instantiate(cfg, search_space=grid), min(self.n_trials, size)

    def declares(self, group: str, option: str, key: str) -> bool:
        """Whether option `option` of config group `group` has the key `key`: the typed schema gives every option of
        the group the same keys; a group typed as a dict (clip) has the keys of each option's own yaml."""
        top = key.split(".")[0]
        if top in schema_keys(group):
            return True
        loaded = self.hydra_context.config_loader.repository.load_config(f"{group}/{option}")
        return loaded is None or top in loaded.config

    def trial_overrides(self, trial: optuna.Trial, space: dict, texts: dict, fixed: list[str], info: dict):
        """A trial's job: its drawn values, the fixed overrides, and the environment that leads it to its study.

        A key of a group that the trial's option of it does not have (clip.max_norm when the trial draws
        clip=value: each clip rule has its own keys) is not passed to that trial."""
        drawn = []
        for key, dist in space.items():
            value = suggest(trial, key, dist)
            drawn.append(f"{key}={texts[key][value] if key in texts else override_text(value)}")
        options = {}  # group -> the option this trial takes, drawn or fixed
        for line in [*drawn, *fixed]:
            key, _, text = line.partition("=")
            if "." not in key and self.is_group(key):
                options[key.lstrip("+~")] = text.strip("'\"")
        kept = []
        for line in [*drawn, *fixed]:
            key = line.partition("=")[0].lstrip("+~")
            group, _, rest = key.partition(".")
            if rest and group in options and not self.declares(group, options[group], rest):
                continue
            kept.append(line)
        env = json.dumps({**info, "trial_id": trial._trial_id, "trial": trial.number}, separators=(",", ":"))
        return [*kept, f"++hydra.job.env_set.{TRIAL_ENV}={override_text(env)}"]

    def sweep(self, arguments: list[str]) -> None:
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        space, texts, fixed = self.search_space(arguments)
        sampler, n_trials = self.make_sampler(space)
        storage = absolute_storage(self.storage or f"sqlite:///{sweep_dir / 'optuna.db'}")
        pruner = instantiate(self.pruner_cfg)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            sampler=sampler,
            pruner=pruner,
            direction=self.direction,
            load_if_exists=True,
        )
        # Job N is trial N of the study (when no other sweep adds trials to it meanwhile).
        job_idx = len(study.trials)
        log.info(
            "Optuna %s: study %s in %s, %s, %s, %d trials (%d at a time), searching %s",
            optuna.__version__,
            self.study_name,
            storage,
            type(sampler).__name__,
            type(pruner).__name__,
            n_trials,
            self.n_jobs,
            ", ".join(space) or "nothing",
        )
        info = {"storage": storage, "study": self.study_name, "pruner": self.pruner_cfg}
        counts = dict.fromkeys(("COMPLETE", "PRUNED", "FAIL"), 0)
        done = 0
        while done < n_trials:
            trials = [study.ask() for _ in range(min(self.n_jobs, n_trials - done))]
            overrides = [self.trial_overrides(t, space, texts, fixed, info) for t in trials]
            returns = self.launcher.launch(overrides, initial_job_idx=job_idx)
            job_idx += len(returns)
            done += len(returns)
            for trial, ret in zip(trials, returns):
                state, value, note = outcome(ret)
                counts[state.name] += 1
                try:  # the grid sampler calls study.stop() once every point has been told: harmless here
                    study.tell(trial, value, state=state)
                except RuntimeError as e:
                    if "Study.stop" not in str(e):
                        raise
                described = f"{value:g}" if value is not None else note
                log.info("trial %d %s: %s %s", trial.number, state.name.lower(), described, trial.params)
        self.write_results(study, sweep_dir, counts)

    def write_results(self, study: optuna.Study, sweep_dir: Path, counts: dict) -> None:
        """`optimization_results.yaml`: the study's best trial so far, and how this sweep's trials ended."""
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        result = {
            "name": "optuna",
            "study_name": study.study_name,
            "trials": {k.lower(): n for k, n in counts.items()},
        }
        if complete:
            best = study.best_trial
            result.update(best_params=best.params, best_value=best.value, best_trial=best.number)
            log.info("best: trial %d, %s -> %g", best.number, best.params, best.value)
        OmegaConf.save(OmegaConf.create(result), sweep_dir / "optimization_results.yaml")
        log.info("trials: %s", ", ".join(f"{n} {k.lower()}" for k, n in counts.items()))
        if not complete:
            raise RuntimeError(
                f"no trial of study {study.study_name} completed ({counts['FAIL']} failed, "
                f"{counts['PRUNED']} pruned); see the trials' train.log in {sweep_dir}"
            )
