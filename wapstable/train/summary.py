"""The run's summary: the figures of `metrics.json` from the run record, the guard's counters and the test sets,
written as strict JSON, atomically."""

import json
import logging
import math
import os
from pathlib import Path

from wapstable.eval.evaluation import combine_sets
from wapstable.train.parts import RunParts
from wapstable.train.record import RunRecord

log = logging.getLogger("wapstable")

TEST_SET_KEYS = ("total", "read", "exprate", "within_1", "within_2", "within_3", "wer")


def training_metrics(record: RunRecord, parts: RunParts) -> dict:
    """The figures of the training so far (validation, skips, anomalies), without a test evaluation."""
    final_valid = record.evals[-1] if record.evals else {}
    counters, budget = parts.guard.counters(), parts.budget
    return {
        "steps": record.step,
        "stopped_by_time": record.stopped_by_time,
        "wall_time_s": round(record.elapsed(), 2),
        "best_valid_exprate": record.best.exprate,
        "best_step": record.best.step,
        "final_valid_exprate": final_valid.get("exprate"),
        "final_valid_wer": final_valid.get("wer"),
        "skipped_steps": budget.total + counters["scaler_skips"],
        "skipped_nonfinite": budget.nonfinite,
        "skipped_spikes": budget.spikes,
        "scaler_skips": counters["scaler_skips"],
        "anomaly_checkpoints": counters["anomaly_checkpoints"],
        "anomalies": record.anomalies,
        "clip_fraction": counters["clipped"] / max(1, counters["accepted"]),
        "localization": record.localization,
        "rollbacks": parts.rollback.events,
        "evals": record.evals,
    }


def test_metrics(sets: dict[str, dict], decode) -> dict:
    """The test figures of metrics.json: all sets together (test_*), and each one (test_sets)."""
    test = combine_sets(sets) if len(sets) > 1 else next(iter(sets.values()))
    return {
        "test_exprate": test["exprate"],
        "test_wer": test["wer"],
        "test_within_1": test["within_1"],
        "test_scales": [float(v) for v in decode.scales],
        "test_length_power": float(decode.length_power),
        "test_sets": {name: {k: r[k] for k in TEST_SET_KEYS} for name, r in sets.items()},
    }


def log_done(metrics: dict, sets: dict[str, dict], rollbacks: list[dict]) -> None:
    """train.log's last lines: each test set, the run's figures, and a warning when it rolled back."""
    for name, r in sets.items():
        log.info(
            "test set %s: ExpRate %.2f%% of %d expressions (%d read), <=1 %.2f%%, <=2 %.2f%%, <=3 %.2f%%, WER %.2f%%",
            name,
            r["exprate"],
            r["total"],
            r["read"],
            r["within_1"],
            r["within_2"],
            r["within_3"],
            r["wer"],
        )
    log.info(
        "done: %d steps in %.0f s; best valid ExpRate %.2f%% (step %d); test ExpRate %.2f%%; %d skipped steps",
        metrics["steps"],
        metrics["wall_time_s"],
        metrics["best_valid_exprate"],
        metrics["best_step"],
        metrics["test_exprate"],
        metrics["skipped_steps"],
    )
    if rollbacks:
        last = rollbacks[-1]
        log.warning(
            "NOT A CLEAN RUN: it rolled back %d times (last at step %d); lr now %.4g, clip threshold %s",
            len(rollbacks),
            last["step"],
            last["lr"],
            last["clip_threshold"],
        )


def strict(x):
    """NaN and Inf as the strings "nan", "inf", "-inf": strict JSON (jq, browsers) has no such numbers."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict(v) for v in x]
    return x


def write_json(path: Path, data: dict) -> None:
    """Write strict JSON atomically (temporary file, then rename)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(strict(data), indent=2, default=str, allow_nan=False))
    os.replace(tmp, path)
