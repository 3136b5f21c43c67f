"""Smoke test of scripts/bench.py --quick: it runs, prints its table and writes every section of bench.json.

No timing is asserted here: speed claims live in the benchmark's own output, measured on a known machine.
"""

import json
import os
import sys

import pytest
from conftest import ROOT, python_run

CLIP_MODES = {"none", "norm", "value", "inf", "agc", "autoclip"}


def positive(x) -> bool:
    return isinstance(x, int | float) and x > 0


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_bench_quick(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), "HYDRA_FULL_ERROR": "1"}
    proc = python_run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, f"bench.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for header in ("| training step |", "| clip mode |", "| attention, forward + backward |", "| data |"):
        assert header in proc.stdout, proc.stdout
    assert "guard + detect_anomaly" in proc.stdout and "skipped" in proc.stdout

    res = json.loads(out.read_text())
    assert res["settings"]["quick"] is True
    assert res["machine"]["cores"] >= 1 and res["machine"]["device"]
    every = res["stats_every"]
    modes = {"bare", "off", "guard", "stats/step", "anomaly", f"stats/{every}"}
    assert modes <= set(res["steps"])
    for name in modes:
        r = res["steps"][name]
        assert positive(r["seconds"]["median"]) and positive(r["ratio"]["median"]), name
        assert positive(r["samples_per_s"]), name
        assert r["ratio"]["q1"] <= r["ratio"]["median"] <= r["ratio"]["q3"], name
    assert res["steps"]["off"]["ratio"]["median"] == 1.0  # the baseline against itself
    assert positive(res["steps"]["stats overhead"]["ratio"]["median"])

    assert set(res["clip"]) == CLIP_MODES
    assert res["clip"]["none"]["ratio"]["median"] == 1.0
    for mode, r in res["clip"].items():
        assert positive(r["seconds"]["median"]) and positive(r["ratio"]["median"]), mode

    skip = res["skip"]
    for k in ("normal", "skipped"):
        assert positive(skip[k]["seconds"]["median"]) and positive(skip[k]["ratio"]["median"]), k
    assert positive(skip["anomaly"]["checkpoint_write_s"]["median"])
    assert positive(skip["anomaly"]["checkpoint_bytes"]) and positive(skip["anomaly"]["localize_s"])

    assert len(res["attention"]) == 5  # softmax and attention step at two sizes, and the whole model
    assert "| watcher, forward + backward |" in proc.stdout and len(res["watcher"]) == 2  # debug=tiny's VGG
    for label, r in res["watcher"].items():
        assert r["first_stride=1"]["ratio"]["median"] == 1.0, label
        assert positive(r["first_stride=2"]["seconds"]["median"]) and positive(
            r["first_stride=2"]["ratio"]["median"]
        )
    for name, r in res["attention"].items():
        for v in ("stable", "naive"):
            assert positive(r[v]["seconds"]["median"]) and positive(r[v]["saved_bytes"]), (name, v)
        assert positive(r["stable"]["ratio"]["median"]), name

    d = res["data"]
    for k in ("samples_per_s", "mean_batch", "step_s", "data_wait_s", "render_images_per_s"):
        assert positive(d[k]), k
    assert 0 < d["data_wait_share"] < 1

    assert set(res["targets"]) == {
        "guard vs guards off",
        "statistics vs guard",
        "stable vs naive attention",
        "data wait share",
        "guard vs plain loop (default)",  # --quick leaves out model=densewap
    }
    r = res["guard_vs_plain"]["default"]
    assert r["plain + clip"]["ratio"]["median"] == 1.0 and positive(r["guarded"]["ratio"]["median"])
    assert "| guard against a plain loop with the same clipping |" in proc.stdout
    for t in res["targets"].values():
        assert positive(t["value"]) and isinstance(t["met"], bool)
