"""scripts/figures.py (`make figures`): every picture of the README from the project's own tools, small PNGs."""

import csv
import json
import sys

import pytest
from conftest import ROOT, python_run
from PIL import Image

from wapstable.cli import figures, figures_data
from wapstable.errors import UserError


def assert_png(path, min_size=(300, 200), max_kb=300):
    """A real PNG of a readable size, saved with a palette so that it stays small in git."""
    assert path.is_file(), path
    with Image.open(path) as im:
        im.verify()  # a truncated or corrupt file raises here
    with Image.open(path) as im:
        assert im.format == "PNG" and im.mode == "P", (path, im.format, im.mode)
        assert im.size[0] >= min_size[0] and im.size[1] >= min_size[1], (path, im.size)
    assert path.stat().st_size < max_kb * 1024, (path, path.stat().st_size)


@pytest.mark.slow
def test_figures_draws_every_picture_from_its_tiny_runs(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("WAPSTABLE_CACHE", str(cache_dir))
    out, work = tmp_path / "docs", tmp_path / "work"
    # The cheap pieces alone: the pictures that need a finished run or a checkpoint are skipped, and say so.
    assert figures.main(["--out", str(out), "--work", str(work)]) == 0
    printed = capsys.readouterr().out
    assert "exprate-curve.png skipped: give --run" in printed
    assert "attention-*.png skipped: give --checkpoint" in printed
    assert "crohme-*.png skipped: give --crohme-run" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "grad-report-fault.png",
        "handwriting.png",
        "images.png",
        "samples.png",
        "sweep-summary.png",
        "symbol-boxes.png",
    ]
    for name in (
        "samples.png",
        "grad-report-fault.png",
        "sweep-summary.png",
        "symbol-boxes.png",
        "handwriting.png",
        "images.png",
    ):
        assert_png(out / name)
    # The gradient report is of a run that skipped its NaN step, and the sweep ran every job: the spiked ones were
    # stopped by the guard, the others finished.
    report = (work / "grad" / "grad_report.md").read_text()
    assert "| 5 | yes |" in report
    with open(work / "summary" / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert (
        sorted((r["fault"], r["status"]) for r in rows)
        == [("lr_spike", "stopped")] * 3 + [("none", "ok")] * 3
    )

    # The other two from the tiny fault run's own results: its metrics.json and its best checkpoint.
    run = work / figures.FAULT_RUN
    args = ["--out", str(out), "--work", str(tmp_path / "work2"), "--only", "exprate", "attention"]
    assert figures.main([*args, "--run", str(run), "--checkpoint", str(run / "checkpoints" / "best.pt")]) == 0
    assert_png(out / "exprate-curve.png")
    for name, _ in figures.ATTENTION:
        assert_png(out / f"attention-{name}.png", min_size=(200, 100))

    # The CROHME pictures from a finished run and a folder of InkML (the tiny run stands in for the preset's).
    from test_crohme import published_layout

    folder = published_layout(tmp_path / "crohme") / "TestEM2014GT"
    args = ["--out", str(out), "--work", str(tmp_path / "work3"), "--only", "crohme", "--crohme", str(folder)]
    assert figures.main([*args, "--crohme-run", str(run)]) == 0
    for name in ("crohme-curve.png", "grad-report-crohme.png"):
        assert_png(out / name)
    assert_png(out / "attention-crohme.png", min_size=(100, 50))
    with pytest.raises(UserError, match="holds no metrics.json; give the directory of a finished experiment"):
        figures.main([*args, "--crohme-run", str(tmp_path)])


def test_exprate_curve_reads_the_evaluations_of_metrics_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    evals = [
        {"step": s, "exprate": e, "wer": w, "loss": 1.0}
        for s, e, w in [(300, 0, 81), (600, 1, 57), (900, 5, 40)]
    ]
    (run / "metrics.json").write_text(
        json.dumps({"steps": 900, "wall_time_s": 450, "test_exprate": 4.0, "evals": evals})
    )
    assert figures.main(["--only", "exprate", "--run", str(run), "--out", str(tmp_path / "docs")]) == 0
    assert_png(tmp_path / "docs" / "exprate-curve.png")

    (run / "metrics.json").write_text(json.dumps({"steps": 900, "evals": []}))
    with pytest.raises(UserError, match="holds no evaluation"):
        figures.main(["--only", "exprate", "--run", str(run), "--out", str(tmp_path / "docs")])


def test_bad_arguments_are_one_sentence_and_exit_2_before_anything_is_drawn(tmp_path):
    out = tmp_path / "docs"
    # A folder that is not a finished run: through the script, as a user calls it.
    proc = python_run(
        [sys.executable, str(ROOT / "scripts" / "figures.py"), "--run", str(tmp_path), "--out", str(out)]
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --run ") and "holds no metrics.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
    # A file that is not a checkpoint, and one that does not exist.
    fake = tmp_path / "best.pt"
    fake.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a checkpoint"):
        figures.main(["--checkpoint", str(fake), "--out", str(out)])
    with pytest.raises(UserError, match="is not a file"):
        figures.main(["--checkpoint", str(tmp_path / "missing.pt"), "--out", str(out)])
    assert not out.exists()


def test_images_figure_without_the_wap_data(tmp_path):
    """images.png is drawn without the WAP data too (its stand-in bitmap), as a small palette PNG; that the three
    images normalise to the same ink is test_images.py's."""
    path = figures_data.images(tmp_path)
    assert_png(path)
