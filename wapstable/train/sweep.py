"""Pruning from inside a trial of the Optuna sweep: report each validation, stop when the pruner says so.

The sweeper (`hydra_plugins/wapstable_optuna`) starts each trial as a Hydra job whose environment
(`hydra.job.env_set`) holds TRIAL_ENV, a JSON object: the study's storage URL, the study's name, the trial's id and
the pruner's config. `pruning_callback` turns it into the trainer's `on_eval`: after each validation the trial
reports its valid ExpRate at that step (the valid loss breaking ties) to the storage, and the pruner compares it
with the finished trials' at the same step. Everything goes through the storage (an SQLite file by default), so a trial running in the sweep's own
process (basic launcher), in a joblib worker or in a submitit job is pruned the same way. Optuna is imported only
inside a trial.
"""

import importlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

TRIAL_ENV = "WAPSTABLE_OPTUNA_TRIAL"


def reported_key(metric: str, maximize: bool) -> str | None:
    """The validation figure that tracks `optimize_metric` in the study's direction: ExpRate for an ExpRate
    maximised, WER or loss for one of those minimised; None (no pruning) when there is none."""
    for key, key_maximize in (("exprate", True), ("within", True), ("wer", False), ("loss", False)):
        if key in metric:
            return ("exprate" if key == "within" else key) if key_maximize == maximize else None
    return None


def build_pruner(spec: Mapping):
    """An Optuna pruner from its config: `_target_` (a class path) and its keyword arguments."""
    module, _, name = spec["_target_"].rpartition(".")
    return getattr(importlib.import_module(module), name)(
        **{k: v for k, v in spec.items() if k != "_target_"}
    )


TIE_BREAK = (
    1e-6  # times the valid loss: ExpRate and WER move in whole samples, and early on they all tie at 0/100
)


def reported_value(record: dict, key: str) -> float:
    """`record[key]`, with the valid loss breaking ties (ExpRate minus, WER plus 1e-6 x loss: far below one sample's
    worth), so that trials that all still read 0 % are told apart by how well they fit; a non-finite loss ranks last."""
    value = float(record[key])
    if key in ("exprate", "wer"):
        loss = float(record.get("loss", 0.0))
        penalty = TIE_BREAK * min(loss, 1e6) if math.isfinite(loss) else 1.0
        value += -penalty if key == "exprate" else penalty
    return value


class TrialReporter:
    """`on_eval` for one trial: reports `record[key]` (ties broken by the loss) at `record["step"]`, returns True
    when the trial is pruned."""

    def __init__(self, trial, key: str):
        self.trial, self.key = trial, key

    def __call__(self, record: dict) -> bool:
        try:
            self.trial.report(reported_value(record, self.key), int(record["step"]))
            return bool(self.trial.should_prune())
        except Exception as e:  # a storage hiccup must not end the trial it is reporting on
            log.warning("could not report step %s to the Optuna study: %s", record["step"], e)
            return False


def pruning_callback(metric: str, environ: Mapping[str, str] = os.environ) -> Callable[[dict], bool] | None:
    """The trainer's `on_eval` inside a sweep's trial (None outside one, or when `metric` has no validation figure
    to report in the study's direction)."""
    spec = environ.get(TRIAL_ENV)
    if not spec:
        return None
    import optuna

    info = json.loads(spec)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the trial's log is the trainer's
    try:
        pruner = build_pruner(info["pruner"])
        study = optuna.load_study(study_name=info["study"], storage=info["storage"], pruner=pruner)
    except Exception as e:  # the trial still trains and the sweeper records its result; it is not pruned
        log.warning(
            "trial %s cannot reach study %s, so it will not be pruned: %s", info["trial"], info["study"], e
        )
        return None
    key = reported_key(metric, study.direction == optuna.study.StudyDirection.MAXIMIZE)
    if key is None:
        log.info("trial %s: optimize_metric=%s has no validation figure to prune on", info["trial"], metric)
        return None
    log.info("trial %s of study %s: valid %s reported at each evaluation", info["trial"], info["study"], key)
    return TrialReporter(optuna.trial.Trial(study, info["trial_id"]), key)
