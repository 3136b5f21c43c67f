"""Evaluation and inference end to end: scripts/evaluate.py, scripts/predict.py, train.py on InkML and WAP pickles."""

import importlib
import json
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, python_run, run_train
from PIL import Image
from test_crohme import write as write_inkml

from wapstable.data.render.mathtext import render
from wapstable.data.sample import Sample
from wapstable.data.sources.wap_pkl import write_wap_split
from wapstable.data.vocab import Vocab
from wapstable.eval import evaluation
from wapstable.eval.attention_maps import upsample_attention
from wapstable.eval.evaluation import prepare_image

EXPR = ["x", "^", "{", "2", "}", "+", "\\frac", "{", "1", "}", "{", "y", "}"]


def script(name, *args):
    """Run scripts/<name> as a user would; returns the CompletedProcess."""
    cmd = [sys.executable, str(ROOT / "scripts" / name), *map(str, args)]
    return python_run(cmd, timeout=300)


def load_script(name):
    """The code of scripts/<name> (wapstable/cli/), to call its main() in this process (no second torch import)."""
    return importlib.import_module(f"wapstable.cli.{name.removesuffix('.py')}")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, cache_dir):
    run = tmp_path_factory.mktemp("eval") / "run"
    run_train([], run, cache_dir)
    return run


# A data set the tiny model learns by heart: five images, the same in every split, the last one drawn as the first
# (an x) but labelled y. The model reads most of them after 60 steps, and never both x's: a run whose ExpRate lies
# between 0 and 100, so that two evaluations agreeing on its figures is not 0 == 0, and it makes errors to print.
READ = [("x", "x"), ("1 + 2", "1 + 2"), ("a ^ { 2 }", "a ^ { 2 }"), ("y - b", "y - b"), ("x", "y")]
# data.normalize=false: the pixels as written; with it on, evaluate.py's images are not the run's (see
# test_evaluate_brings_the_images_to_the_ink_the_run_read below)
READ_DATA = ["data=wap_pkl", "data.normalize=false"]
LEARN = [
    "optim=adam",
    "optim.lr=1e-2",
    "trainer.max_steps=60",
    "trainer.eval_every=60",
    "trainer.checkpoint_every=60",
]


def write_read_set(root) -> list[str]:
    """READ as WAP pickles under `root`; returns train.py's data overrides for it."""
    samples = [
        Sample(f"r{i}", render(drawn.split(), "cm", 16, None, False), label.split())
        for i, (drawn, label) in enumerate(READ)
    ]
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        write_wap_split(samples, root / f"offline-{split}.pkl", root / f"{split}_caption.txt")
    Vocab.build([s.tokens for s in samples]).save(root / "dictionary.txt")
    return [*READ_DATA, f"data.root={root}"]


def assert_reads(figures: dict) -> None:
    """Figures of a run that read some of READ and not all: 0 < ExpRate < 100 (the two x's cannot both be right)."""
    assert 0 < figures["exprate"] < 100 and 0 < figures["wer"] < 100, figures


@pytest.fixture(scope="module")
def reading_run(tmp_path_factory, cache_dir):
    """A tiny run that learned READ (its final test reads some of it)."""
    tmp = tmp_path_factory.mktemp("read")
    run = tmp / "run"
    run_train([*write_read_set(tmp / "wap"), *LEARN], run, cache_dir)
    return run


# ---------------------------------------------------------------------------------------------------------------
# evaluate.py


def test_evaluate_prints_the_table_and_writes_json(reading_run):
    ckpt = reading_run / "checkpoints" / "best.pt"
    proc = script("evaluate.py", ckpt)
    assert proc.returncode == 0, proc.stderr
    for word in ("exprate", "within_1", "within_3", "wer", "length"):
        assert word in proc.stdout
    result = json.loads((ckpt.parent / "eval-test.json").read_text())
    for key in ("count", "exprate", "within_1", "within_2", "within_3", "wer", "by_length"):
        assert key in result, key
    n = len(READ)
    assert result["count"] == n and result["split"] == "test" and result["beam_size"] == 10  # final_beam_size
    assert sum(b["count"] for b in result["by_length"].values()) == n
    # one evaluation path: with the checkpoint's own config it reproduces the run's final test numbers, on a model
    # that reads some expressions and not others (agreement only: that the figures themselves are right is pinned
    # on hand-made predictions in tests/test_exact_eval.py)
    metrics = json.loads((reading_run / "metrics.json").read_text())
    assert_reads(result)
    assert result["exprate"] == pytest.approx(metrics["test_exprate"])
    assert result["within_1"] == pytest.approx(metrics["test_within_1"])
    assert result["wer"] == pytest.approx(metrics["test_wer"])


@pytest.mark.xfail(
    strict=True,
    reason="with data.normalize a run brings its images to data.ink_stroke/ink_symbol but records the ink measured "
    "on them (with ranges) in its checkpoint, so evaluate.py (and a resumed run) bring theirs to another ink",
)
def test_evaluate_brings_the_images_to_the_ink_the_run_read(tmp_path, cache_dir):
    """With data.normalize (wap_pkl's default) evaluate.py reads a checkpoint's test split at the checkpoint's ink
    (load_splits(..., ink=model.ink_stats)): the pixels must be those the run itself was tested on."""
    from conftest import TINY, build_trainer

    from wapstable.data.batches import load_splits

    data = [*write_read_set(tmp_path / "wap"), "data.normalize=true", "data.height=32"]
    trainer = build_trainer([*TINY, *data], tmp_path / "run", cache_dir)
    ran = trainer.splits["test"]
    read = load_splits(trainer.cfg.data, which=("test",), ink=trainer.ink_stats)["test"]
    assert [s.id for s in read] == [s.id for s in ran]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(read, ran))


def test_evaluate_overrides_and_errors(tiny_run, tmp_path, capsys):
    ckpt = tiny_run / "checkpoints" / "best.pt"
    evaluate = load_script("evaluate.py")
    out = tmp_path / "valid.json"
    assert evaluate.main([str(ckpt), "split=valid", "decode.beam_size=3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["split"] == "valid" and result["beam_size"] == 3 and result["count"] == 8
    assert "within_2" in capsys.readouterr().out

    # decode.scales: each image read at several sizes, the likelier reading kept; a bad factor refused
    scaled = tmp_path / "scaled.json"
    args = [
        str(ckpt),
        "split=valid",
        "decode.beam_size=1",
        "decode.scales=[1.0,0.5,2.0]",
        "--out",
        str(scaled),
    ]
    assert evaluate.main(args) == 0
    scaled = json.loads(scaled.read_text())
    assert scaled["count"] == 8 and scaled["scales"] == [1.0, 0.5, 2.0]
    with pytest.raises(
        evaluate.UserError, match=r"decode.scales=\[1.0, -1.0\] must list one or more factors"
    ):
        evaluate.main([str(ckpt), "decode.scales=[1.0,-1.0]"])
    with pytest.raises(evaluate.UserError, match="model comes from the checkpoint"):
        evaluate.main([str(ckpt), "model.hidden_dim=8"])
    with pytest.raises(evaluate.UserError, match="data.root"):
        evaluate.main([str(ckpt), "data=crohme", f"data.root={tmp_path / 'nowhere'}"])
    # a CLI error is one sentence on stderr and exit code 2
    proc = script("evaluate.py", tmp_path / "missing.pt")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "missing.pt does not exist" in proc.stderr


def test_evaluate_writes_predictions_and_prints_the_frequent_edits(reading_run, tmp_path, capsys):
    from wapstable.eval.metrics import confusions, edit_distance

    ckpt = reading_run / "checkpoints" / "best.pt"
    evaluate = load_script("evaluate.py")
    path = tmp_path / "deep" / "pred.jsonl"
    out = tmp_path / "valid.json"
    args = [str(ckpt), "split=valid", "decode.beam_size=1", "--out", str(out), "--predictions", str(path)]
    assert evaluate.main(args) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    result = json.loads(out.read_text())
    n = len(READ)
    assert len(rows) == result["count"] == n and [r["id"] for r in rows] == [f"r{i}" for i in range(n)]
    assert not list(path.parent.glob("*.tmp"))  # written whole, then renamed
    assert [r["truth"] for r in rows] == [label.split() for _, label in READ]
    for r in rows:
        assert r["errors"] == edit_distance(r["truth"], r["prediction"])
    # the records are the scored ones: their exact share is the ExpRate, their edits the WER (some read, some not)
    assert_reads(result)
    assert rows[0]["prediction"] == rows[-1]["prediction"]  # one image, one reading: x or y, not both right
    assert 100.0 * sum(r["errors"] == 0 for r in rows) / n == pytest.approx(result["exprate"])
    edits, tokens = sum(r["errors"] for r in rows), sum(len(r["truth"]) for r in rows)
    assert 100.0 * edits / tokens == pytest.approx(result["wer"])
    # the printed edits are those of the records, most frequent first
    printed = capsys.readouterr().out.split("reference -> predicted\n", 1)[1].splitlines()
    counts = confusions((r["truth"], r["prediction"]) for r in rows)
    assert sum(counts.values()) == edits
    assert printed and len(printed) == min(15, len(counts))
    top, top_count = counts.most_common(1)[0]
    assert printed[0].split() == [str(top_count), top[0] or "<none>", "->", top[1] or "<none>"]
    # a folder is refused before anything is evaluated or written
    with pytest.raises(evaluate.UserError, match="is a folder"):
        evaluate.main([str(ckpt), "--predictions", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# predict.py


def test_prepare_image_inverts_crops_and_scales():
    ink = render(EXPR, "cm", 16, None, False)  # ink bright on 0, as the model reads it
    paper = 255 - np.pad(ink, 20)  # dark ink on white with a wide border
    got = prepare_image(paper)
    assert got.dtype == np.uint8 and got[0].max() == 0 and got.max() == 255
    assert abs(got.shape[0] - ink.shape[0]) <= 2 and abs(got.shape[1] - ink.shape[1]) <= 2  # cropped
    assert np.array_equal(prepare_image(np.pad(ink, 20), invert="auto"), got)  # already bright ink: kept
    with pytest.raises(ValueError, match="no ink"):  # forced: nothing is brighter than the white page
        prepare_image(paper, invert="no")
    # a gray scan background becomes 0
    scan = np.where(paper > 127, 200, 40).astype(np.uint8)
    assert prepare_image(scan)[0].max() == 0
    assert prepare_image(paper, height=48).shape[0] == 48
    h, w = prepare_image(paper, max_pixels=400).shape
    assert h * w <= 420
    with pytest.raises(ValueError, match="no ink"):
        prepare_image(np.full((20, 20), 255, np.uint8))


def test_upsample_attention_covers_the_image():
    att = np.zeros((1, 2, 3), np.float32)
    att[0, 1, 2] = 1.0  # the bottom-right cell of a stride-4 grid over a 7 x 10 image
    up = upsample_attention(att, 4, (7, 10))
    assert up.shape == (1, 7, 10)
    assert np.unravel_index(up[0].argmax(), up[0].shape)[1] >= 8 and up[0, :3, :5].max() < 0.1


def test_predict_prints_latex_and_draws_attention(tiny_run, tmp_path):
    paths = []
    for i, expr in enumerate([EXPR, ["a", "+", "b"]]):
        ink = render(expr, "cm", 16, None, False)
        path = tmp_path / f"expr{i}.png"
        Image.fromarray(255 - ink).save(path)  # dark on white, as a scan or a rendering would be
        paths.append(path)
    out = tmp_path / "att.png"
    proc = script("predict.py", tiny_run / "checkpoints" / "best.pt", *paths, "--beam", 2, "--attention", out)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and [line.split("\t")[0] for line in lines] == [str(p) for p in paths]
    for n in (1, 2):
        with Image.open(tmp_path / f"att-{n}.png") as im:
            assert im.width > 200 and im.height > 100

    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    proc = script("predict.py", tiny_run / "checkpoints" / "best.pt", bad)
    assert proc.returncode == 2 and "notes.png" in proc.stderr and proc.stdout == ""


# ---------------------------------------------------------------------------------------------------------------
# train.py on real-data formats

TRUTHS = [r"$x^2$", r"$\frac{1}{2}$", r"$a+b$", r"$\sqrt{x}$", r"$x_1$", r"$\left( a \right)$"]
SMALL = ["data.height=32", "data.batch.pixel_budget=20000", "data.batch.max_image_pixels=20000"]


def crohme_root(tmp_path):
    root = tmp_path / "crohme"
    for split in ("train", "valid", "test"):
        (root / split).mkdir(parents=True)
        for i, truth in enumerate(TRUTHS):
            write_inkml(root / split / f"{split}_{i}.inkml", truth=truth)
    return root


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_train_on_crohme_inkml(tmp_path, cache_dir):
    """The layout a user has (train/valid/test folders of InkML), and the fail/skip policy."""
    root = crohme_root(tmp_path)
    folders = ["data.train=train", "data.valid=valid", "data.test_sets=null", "data.test=test"]
    run = tmp_path / "run"
    run_train(["data=crohme", f"data.root={root}", *folders, *SMALL], run, cache_dir)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 3 and "test_exprate" in metrics and list(metrics["test_sets"]) == ["test"]

    write_inkml(root / "train" / "broken.inkml", text="<ink><trace>1 2, 3 4</trace>")
    run = tmp_path / "skip"
    run_train(
        ["data=crohme", f"data.root={root}", *folders, *SMALL], run, cache_dir
    )  # skip: data=crohme's own
    log = (run / "train.log").read_text()
    assert "broken.inkml" in log and "skipped 1 x malformed XML" in log
    report = json.loads((run / "data_report.json").read_text())
    assert report["skipped"]["train"] == {"malformed XML": 1} and report["files"]["train"] == len(TRUTHS) + 1
    assert (run / "metrics.json").is_file()

    fail = ["data=crohme", f"data.root={root}", *folders, "data.on_error=fail", *SMALL]
    proc = run_train(fail, tmp_path / "fail", cache_dir, check=False)
    assert proc.returncode == 2 and "broken.inkml" in proc.stdout + proc.stderr
    assert not (tmp_path / "fail" / "checkpoints").exists()


def test_train_on_the_published_crohme_layout(tmp_path, cache_dir, tiny_run, monkeypatch):
    """data=crohme on CROHME_labeled_2016 as published: a held-out validation split, the 2014 and 2016 test sets
    reported apart over all of their files, init_from a model of the rendered data, evaluate.py one row per set."""
    from test_crohme import QUIRKS, published_layout

    root = published_layout(tmp_path / "CROHME_labeled_2016")
    write_inkml(root / "TestEM2014GT" / "broken.inkml", text="<ink>")
    run = tmp_path / "run"
    args = ["data=crohme", f"data.root={root}", "data.valid_fraction=0.3", *SMALL]
    proc = run_train([*args, f"init_from={tiny_run / 'checkpoints' / 'best.pt'}"], run, cache_dir)
    metrics = json.loads((run / "metrics.json").read_text())
    sets = metrics["test_sets"]
    assert list(sets) == ["2014", "2016"]
    assert (sets["2014"]["total"], sets["2014"]["read"]) == (len(QUIRKS) + 1, len(QUIRKS))
    assert (sets["2016"]["total"], sets["2016"]["read"]) == (len(QUIRKS), len(QUIRKS))
    report = json.loads((run / "data_report.json").read_text())
    assert report["skipped"]["test 2014"] == {"malformed XML": 1} and report["test_sets"]["2014"] == 5
    log = (run / "train.log").read_text()
    assert "init_from" in log and "tokens shared" in log and "test set 2014: ExpRate" in log
    assert (run / "vocab.txt").read_text().count("\n") == 111  # the CROHME 2014 dictionary and <eol>

    ckpt = run / "checkpoints" / "best.pt"
    proc = script("evaluate.py", ckpt, "data=crohme", f"data.root={root}", "split=test")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()}
    assert rows["2014"][1:3] == ["5", "4"] and rows["2016"][1:3] == ["4", "4"]
    assert {"ExpRate", "<=1", "<=2", "<=3", "WER"} <= set(
        rows["test"]
    )  # the header: `test set total read ...`
    result = json.loads((run / "checkpoints" / "eval-test.json").read_text())
    for name in ("2014", "2016"):  # the printed rows are the JSON's, and the run's own figures again
        printed = [float(v) for v in rows[name][3:]]
        keys = ("exprate", "within_1", "within_2", "within_3", "wer")
        assert printed == pytest.approx([result["sets"][name][k] for k in keys], abs=0.01), name
        assert result["sets"][name]["wer"] == pytest.approx(sets[name]["wer"]), name
    # Those figures cannot tell two sets of pixels apart: every training file holds the same ink, so the model reads
    # nothing (WER 100 on both sides). What they stand for is checked directly: data=crohme kept the checkpoint's
    # pixel settings (data.height=32), not the group's defaults (64), so evaluate.py decodes the run's images.
    heights = []
    real = evaluation.decode

    def decode(model, images, image_mask, *args, **kw):
        heights.extend(int(m.any(-1).sum()) for m in image_mask)  # each image's own height, padding left out
        return real(model, images, image_mask, *args, **kw)

    monkeypatch.setattr(evaluation, "decode", decode)
    monkeypatch.setenv("WAPSTABLE_CACHE", str(cache_dir))
    threads = torch.get_num_threads()
    try:
        args = [str(ckpt), "data=crohme", f"data.root={root}", "--out", str(tmp_path / "h.json")]
        assert load_script("evaluate.py").main(args) == 0
    finally:
        torch.set_num_threads(threads)
    assert len(heights) == 8 and set(heights) == {32}, heights

    one = script(
        "evaluate.py",
        ckpt,
        "data=crohme",
        f"data.root={root}",
        "~data.test_sets.2016",
        "--out",
        tmp_path / "e.json",
    )
    assert one.returncode == 0, one.stderr
    assert list(json.loads((tmp_path / "e.json").read_text())["sets"]) == ["2014"]


def test_train_on_wap_pickles(tmp_path, cache_dir):
    root = tmp_path / "wap"
    root.mkdir()
    labels = [t.split() for t in ("x ^ { 2 }", "a + b", "\\frac { 1 } { 2 }", "x - 1")]
    splits = {
        split: [Sample(f"{split}_{i}", render(t, "cm", 16, None, False), t) for i, t in enumerate(labels)]
        for split in ("train", "valid", "test")
    }
    for split, samples in splits.items():
        write_wap_split(samples, root / f"offline-{split}.pkl", root / f"{split}_caption.txt")
    Vocab.build(labels).save(root / "dictionary.txt")
    run = tmp_path / "run"
    run_train(["data=wap_pkl", f"data.root={root}", *SMALL], run, cache_dir)
    assert json.loads((run / "metrics.json").read_text())["steps"] == 3
    assert (run / "vocab.txt").read_text() == (
        root / "dictionary.txt"
    ).read_text()  # the data set's dictionary

    unknown = Sample("valid_9", splits["valid"][0].image, ["x", "\\int", "2"])  # \int: not in the dictionary
    write_wap_split([*splits["valid"], unknown], root / "offline-valid.pkl", root / "valid_caption.txt")
    proc = run_train(["data=wap_pkl", f"data.root={root}", *SMALL], tmp_path / "fail", cache_dir, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "valid_9" in out and "\\int" in out
