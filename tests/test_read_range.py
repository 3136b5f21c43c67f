"""data.read_range: the symbol sizes a checkpoint records as read well are measured on the validation split at the end
of training, not taken from the augmentation's range, and evaluate.py and predict.py normalise to them."""

import json
import sys

import pytest
from conftest import ROOT, TINY, compose_config, python_run, refusal_in_process, run_train

from wapstable.checkpoint import load_checkpoint
from wapstable.data.normalize import InkStats, read_factors, readings_at
from wapstable.errors import UserError

READINGS = {0.7: 20.0, 0.85: 28.0, 1.0: 30.0, 1.2: 27.5, 1.4: 26.0}


@pytest.mark.parametrize(
    "readings, tolerance, expected",
    [
        (READINGS, 3.0, (0.85, 1.2)),  # 0.7 reads 10 below, 1.4 4 below
        (READINGS, 0.0, (1.0, 1.0)),  # nothing reads as well as scale 1
        (READINGS, 10.0, (0.7, 1.4)),  # every factor within the tolerance
        ({0.7: 30.0, 0.85: 10.0, 1.0: 30.0}, 3.0, (1.0, 1.0)),  # 0.7 is not reached past 0.85
        ({1.0: 12.0}, 3.0, (1.0, 1.0)),  # no other factor read
        ({0.5: 9.0, 1.0: 12.0, 2.0: 9.0}, 3.0, (0.5, 2.0)),  # exactly at the tolerance counts as read
        ({0.7: 0.0, 1.0: 0.0, 1.2: 0.0}, 3.0, None),  # nothing read at scale 1: no range measured
    ],
)
def test_read_factors(readings, tolerance, expected):
    assert read_factors(readings, tolerance) == expected


@pytest.mark.parametrize(
    "scales, read_in_order",
    [
        ([1.4, 0.7, 1.2], [0.7, 1.0, 1.2, 1.4]),  # scale 1 added, smallest first
        ([1.0, 0.85], [0.85, 1.0]),  # scale 1 given: read once
        ([], [1.0]),
    ],
)
def test_readings_at_reads_scale_1_and_each_scale_once(scales, read_in_order):
    read = []
    readings = readings_at(lambda f: read.append(f) or 10 * f, scales)
    assert read == read_in_order
    assert readings == {f: 10 * f for f in read_in_order}


@pytest.mark.parametrize(
    "override, named",
    [
        ("data.read_range.scales=[0.2,1.2]", "data.read_range.scales"),
        ("data.read_range.scales=[5.0]", "data.read_range.scales"),
        ("data.read_range.tolerance=-1", "data.read_range.tolerance"),
    ],
)
def test_read_range_refusals(tmp_path, cache_dir, override, named):
    assert named in refusal_in_process([override], tmp_path / "run", cache_dir)


def test_the_measured_range_is_what_the_checkpoints_record(tmp_path, cache_dir, monkeypatch):
    """With readings given, the range from them (not from data.pixel_aug.scale) goes into best.pt and last.pt,
    metrics.json and the model evaluate.py loads; the pen range and the medians stay as they were."""
    from wapstable.eval.evaluation import load_model
    from wapstable.train.evaluator import Evaluator
    from wapstable.train.stages import train

    asked, shown = [], []

    def readings(self, best_path, scales):
        asked.append((best_path.name, list(scales)))
        shown.append(
            InkStats.from_dict(load_checkpoint(best_path)["ink_stats"])
        )  # as recorded during training
        return READINGS

    monkeypatch.setattr(Evaluator, "read_scales", readings)
    run = tmp_path / "run"
    cfg = compose_config(
        [*TINY, "data.read_range.scales=[0.7,0.85,1.2,1.4]", "data.pixel_aug.scale=[0.7,1.4]"], run_dir=run
    )
    cfg.data.cache_dir = str(cache_dir)
    metrics = train(cfg)
    assert asked == [("best.pt", [0.7, 0.85, 1.2, 1.4])]
    assert metrics["read_factors"] == [0.85, 1.2]
    assert metrics["read_scales"] == {"0.7": 20.0, "0.85": 28.0, "1": 30.0, "1.2": 27.5, "1.4": 26.0}
    assert json.loads((run / "metrics.json").read_text())["read_factors"] == [0.85, 1.2]
    recorded = InkStats.from_dict(metrics["ink_stats"])
    for name in ("best.pt", "last.pt"):
        assert InkStats.from_dict(load_checkpoint(run / "checkpoints" / name)["ink_stats"]) == recorded
        assert load_model(run / "checkpoints" / name)[0].ink_stats == recorded
    # shown in training: the quartiles x [0.7, 1.4]; recorded: the same quartiles x [0.85, 1.2], the symbols' and
    # the pen's alike (a resampled image's pen is resampled with it); the medians stay
    (before,) = shown
    for key in ("symbol_range", "stroke_range"):
        lo, hi = getattr(before, key)
        assert getattr(recorded, key) == pytest.approx((lo / 0.7 * 0.85, hi / 1.4 * 1.2)), key
    assert (recorded.symbol_size, recorded.stroke_width) == (before.symbol_size, before.stroke_width)


def test_evaluate_read_range_on_an_existing_checkpoint(tmp_path, cache_dir, monkeypatch):
    """wapstable-evaluate CKPT --read-range OUT: the same measure for a checkpoint trained without it, written to a
    copy (the checkpoint itself untouched); one from before the factors were kept is taken as widened by its
    data.pixel_aug.scale."""
    import wapstable.cli.evaluate as evaluate
    from wapstable.checkpoint import save_checkpoint

    run = tmp_path / "run"
    run_train(["data.pixel_aug.scale=[0.7,1.4]"], run, cache_dir)
    ckpt = run / "checkpoints" / "best.pt"
    state = load_checkpoint(ckpt)
    shown = InkStats.from_dict(state["ink_stats"])
    assert shown.factors == (0.7, 1.4)
    old = tmp_path / "old.pt"  # as written before InkStats kept its factors
    state["ink_stats"].pop("factors")
    save_checkpoint(state, old)
    scales_read = []

    def fake(model, vocab, samples, beam, *args, scales=(1.0,), **kw):
        scales_read.append((beam, scales))
        return {"exprate": READINGS[scales[0]]}

    monkeypatch.setattr(evaluate, "evaluate_samples", fake)
    untouched = ckpt.read_bytes()
    for source in (ckpt, old):
        out = tmp_path / f"read-{source.stem}.pt"
        assert evaluate.main([str(source), "--read-range", str(out)]) == 0
        recorded = InkStats.from_dict(load_checkpoint(out)["ink_stats"])
        assert recorded.factors == (0.85, 1.2)
        for key in ("symbol_range", "stroke_range"):
            lo, hi = getattr(shown, key)
            assert getattr(recorded, key) == pytest.approx((lo / 0.7 * 0.85, hi / 1.4 * 1.2)), key
        assert load_checkpoint(out)["model"].keys() == state["model"].keys()
    assert ckpt.read_bytes() == untouched
    assert scales_read[:5] == [(1, (f,)) for f in (0.7, 0.85, 1.0, 1.2, 1.4)]  # greedy, each scale alone
    with pytest.raises(UserError, match="validation split"):
        evaluate.main([str(ckpt), "--read-range", str(tmp_path / "x.pt"), "split=test"])
    with pytest.raises(UserError, match="data.read_range.scales"):
        evaluate.main([str(ckpt), "--read-range", str(tmp_path / "x.pt"), "data.read_range.scales=[9.0]"])
    assert not (tmp_path / "x.pt").exists()


def test_evaluate_read_range_refuses_a_model_that_reads_nothing(tmp_path, cache_dir):
    """The real measurement through the script: a 3-step model reads none of its validation split, so there is no
    range to record: one sentence, exit 2, nothing written."""
    run = tmp_path / "run"
    run_train([], run, cache_dir)
    out = tmp_path / "read.pt"
    script = str(ROOT / "scripts" / "evaluate.py")
    proc = python_run(
        [sys.executable, script, run / "checkpoints" / "best.pt", "--read-range", out], timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "reads none of the validation split" in proc.stderr and "scale 1: valid ExpRate 0.00" in proc.stdout
    )
    assert not out.exists()
