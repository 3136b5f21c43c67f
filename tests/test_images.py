"""Images from elsewhere: the ink normaliser, the per-batch pixel augmentation, data=images in both layouts through
train.py, and predict.py on a dark-on-light image and its inverted copy."""

import json
import os
import sys

import numpy as np
import pytest
import torch
from conftest import python_run, refusal_in_process, run_train
from PIL import Image, ImageDraw, ImageFont

from wapstable.data.batches import Batch
from wapstable.data.ink.raster import rasterize_traces
from wapstable.data.normalize import InkStats, measure, normalize, to_ink, training_stats
from wapstable.data.pixel_aug import active, augment_batch, check_pixel_aug
from wapstable.errors import UserError

TARGET = InkStats(2.3, 31.0)


def strokes(seed: int) -> list[np.ndarray]:
    """A few pen strokes of a handwritten-looking expression: an x, a 2 and a bar, placed by `seed`."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(3):
        x0 = 40.0 * k + rng.uniform(0, 5)
        out += [
            np.array([[x0, 0], [x0 + 20, 30]]),
            np.array([[x0 + 20, 0], [x0, 30]]),
            np.array([[x0 + 2, 40 + t] for t in range(0, 10, 2)])
            if k == 1
            else np.array([[x0, 45], [x0 + 25, 45]]),
        ]
    return out


@pytest.mark.parametrize("pen", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [14, 24, 48])
def test_normalize_brings_any_pen_and_size_to_the_target(pen, size):
    image = rasterize_traces(strokes(pen), height=400, line_width=pen, symbol_size=size)
    before = measure(to_ink(image))
    after = measure(to_ink(normalize(image, TARGET)))
    assert abs(after.stroke_width - TARGET.stroke_width) < 0.6, (before, after)
    assert abs(np.log(after.symbol_size / TARGET.symbol_size)) < 0.2, (before, after)


def test_polarity_contrast_and_colour_read_the_same_ink():
    bright = rasterize_traces(strokes(0), height=200, line_width=3, symbol_size=30)
    rng = np.random.default_rng(0)
    # a scan: dark grey ink on light grey paper with noise, and the same in colour
    scan = (
        (200 - bright.astype(np.float32) * 0.6 + rng.normal(0, 6, bright.shape)).clip(0, 255).astype(np.uint8)
    )
    colour = np.stack([scan, scan, (scan * 0.9).astype(np.uint8)], -1)
    want = normalize(bright, TARGET)
    for other in (255 - bright, scan, colour):
        got = normalize(other, TARGET)
        assert got.shape == want.shape
        assert (got != want).mean() < 0.02  # the same ink, a few edge pixels apart at most
    assert normalize(bright, TARGET).dtype == np.uint8 and set(np.unique(want)) <= {0, 255}


def test_training_stats_and_a_blank_image():
    images = [rasterize_traces(strokes(s), height=200, line_width=2, symbol_size=24) for s in range(5)]
    stats = training_stats(images)
    assert 1.8 < stats.stroke_width < 2.8 and 20 < stats.symbol_size < 45
    assert training_stats([]) is None and measure(np.zeros((9, 9), bool)) is None
    assert not normalize(np.full((20, 20), 200, np.uint8), TARGET).any()  # one flat colour: no ink, no crash
    assert InkStats.from_dict(stats.as_dict()) == stats
    wide = training_stats(images, scale=(0.7, 1.4), pen=True)  # what data.pixel_aug lets the model see
    assert wide.stroke_range[0] < stats.stroke_range[0] and wide.stroke_range[1] > stats.stroke_range[1] + 2
    assert (
        wide.symbol_range[0] < stats.symbol_range[0] * 0.75 and wide.symbol_range[1] > stats.symbol_range[1]
    )
    assert InkStats.from_dict(wide.as_dict()) == wide


def test_ink_inside_the_trained_range_keeps_its_pixels():
    """A 4-px pen at 1.2x the size: redrawn and resampled for a model of one pen and size, kept as it is for a
    model whose training ranges (data.pixel_aug) cover it."""
    image = rasterize_traces(strokes(1), height=400, line_width=4, symbol_size=29)
    found = measure(to_ink(image))
    bare = normalize(image, TARGET)
    covered = TARGET._replace(stroke_range=(1.0, 6.0), symbol_range=(15.0, 60.0))
    kept = normalize(image, covered)
    assert np.array_equal(kept, normalize(image, None))  # polarity, contrast and crop only
    assert abs(measure(to_ink(kept)).stroke_width - found.stroke_width) < 0.3
    assert abs(measure(to_ink(bare)).stroke_width - TARGET.stroke_width) < 0.6
    pen_only = normalize(
        image, TARGET._replace(symbol_range=(15.0, 60.0))
    )  # the size is kept, the pen is not
    assert (
        pen_only.shape == kept.shape
        and abs(measure(to_ink(pen_only)).stroke_width - TARGET.stroke_width) < 0.6
    )


def batch(h=40, w=60, n=3):
    images = torch.zeros(n, 1, h, w)
    images[:, :, 10:30:4, 5:50] = 1.0  # 1-px lines
    mask = torch.ones(n, h, w)
    mask[-1, :, 40:] = 0  # the last image is narrower
    images *= mask[:, None]
    regions = torch.tensor([[[5.0, 10.0, 50.0, 30.0]]]).repeat(n, 1, 1)
    return Batch(images, mask, torch.zeros(n, 2, dtype=torch.long), torch.ones(n, 2), ["a"] * n, regions)


def test_pixel_aug_defaults_change_nothing_and_draw_nothing():
    b = batch()
    state = torch.get_rng_state()
    out = augment_batch(b)
    assert torch.equal(out.images, b.images) and torch.equal(torch.get_rng_state(), state)


def test_pixel_aug_scale_pen_blur_binarize():
    b = batch()
    torch.manual_seed(0)
    sizes = {augment_batch(b, (0.7, 1.4)).images.shape[-1] for _ in range(30)}
    assert min(sizes) >= round(60 * 0.7) and max(sizes) <= round(60 * 1.4) and len(sizes) > 5
    big = augment_batch(b, (2.0, 2.0))
    assert big.images.shape[-2:] == (80, 120) and big.image_mask.shape[-2:] == (80, 120)
    assert torch.allclose(big.regions[0, 0], torch.tensor([10.0, 20.0, 100.0, 60.0]))
    assert not big.images[-1, :, :, 80:].any()  # the padding stays background
    ink = b.images.sum()
    pens = [augment_batch(b, pen=1.0).images.sum() for _ in range(20)]
    assert min(pens) < ink < max(pens)  # thinner and thicker pens both drawn
    many = batch(n=40)
    thin = -torch.nn.functional.max_pool2d(torch.nn.functional.pad(-many.images, (0, 1, 0, 1)), 2, stride=1)
    half = augment_batch(many, pen=0.5).images  # each image kept, or changed the one way drawn for it
    kept = [torch.equal(half[i], many.images[i]) for i in range(40)]
    assert 5 < sum(kept) < 35 and not half[-1, :, :, 40:].any()  # the padding stays background after a pen
    assert any(torch.equal(half[i], thin[i] * many.image_mask[i]) for i in range(40) if not kept[i])
    blurred = augment_batch(b, blur=1.0).images
    assert ((blurred > 0.05) & (blurred < 0.95)).any()
    binary = augment_batch(augment_batch(b, blur=1.0), binarize=1.0).images
    assert set(binary.unique().tolist()) <= {0.0, 1.0}


def test_pixel_aug_refusals():
    from omegaconf import OmegaConf

    for bad in ({"scale": [1.5, 1.0]}, {"scale": [0.1, 1.0]}, {"scale": [1.0]}, {"pen": 1.5}, {"blur": -0.1}):
        aug = OmegaConf.create({"scale": [1.0, 1.0], "pen": 0.0, "blur": 0.0, "binarize": 0.0, **bad})
        with pytest.raises(UserError, match="data.pixel_aug"):
            check_pixel_aug(aug)
    assert not active(OmegaConf.create({"scale": [1.0, 1.0], "pen": 0, "blur": 0, "binarize": 0}))


# ---- data=images through train.py ----

LABELS = ["1 + 2", "3 - 4", "5 = 6", "7 + 8", "9 - 1", "2 = 3", "4 + 5", "6 - 7"]


def picture(label: str, size: int, dark_on_light: bool) -> Image.Image:
    font = ImageFont.load_default(size=size)
    text = label.replace(" ", "")
    w, h = int(size * 0.7 * len(text)) + 20, size + 20
    im = Image.new("L", (w, h), 255 if dark_on_light else 0)
    ImageDraw.Draw(im).text((10, 5), text, fill=0 if dark_on_light else 255, font=font)
    return im


def comer_folder(root, splits=("train", "2014")):
    """CoMER's layout: SPLIT/img/KEY.bmp with SPLIT/caption.txt (white ink on black, as its bitmaps)."""
    for split in splits:
        (root / split / "img").mkdir(parents=True)
        lines = []
        for k, label in enumerate(LABELS * (3 if split == "train" else 1)):
            key = f"{split}_{k}"
            picture(label, 20 + k % 3 * 6, dark_on_light=False).save(root / split / "img" / f"{key}.bmp")
            lines.append(f"{key}\t{label}")
        (root / split / "caption.txt").write_text("\n".join(lines) + "\n")
    return root


def hme_folder(root):
    """HME100K's layout: train_images/KEY.jpg with train_labels.txt (keys with their extension, LaTeX unspaced,
    dark ink on light paper), and a test split likewise."""
    for split in ("train", "test"):
        (root / f"{split}_images").mkdir(parents=True)
        lines = []
        for k, label in enumerate(LABELS * (3 if split == "train" else 1)):
            key = f"{split}_{k}.jpg"
            picture(label, 22 + k % 2 * 8, dark_on_light=True).save(root / f"{split}_images" / key)
            lines.append(f"{key}\t{label.replace(' ', '')}")
        (root / f"{split}_labels.txt").write_text("\n".join(lines) + "\n")
    return root


def test_train_on_a_comer_folder(tmp_path, cache_dir):
    root = comer_folder(tmp_path / "comer")
    (root / "train" / "img" / "train_3.bmp").write_bytes(b"not an image")  # skipped and counted
    run = tmp_path / "run"
    run_train(
        [
            "data=images",
            f"data.root={root}",
            "data.valid_fraction=0.3",
            "data.symbols=crohme",
            "+data.test_sets.2014=2014",
        ],
        run,
        cache_dir,
    )
    metrics = json.loads((run / "metrics.json").read_text())
    assert "2014" in json.dumps(metrics)
    report = json.loads((run / "data_report.json").read_text())
    assert "unreadable image" in json.dumps(report)
    from wapstable.checkpoint import load_checkpoint

    stats = load_checkpoint(run / "checkpoints" / "last.pt")["ink_stats"]
    # data.normalize brought every training image to data.ink_stroke / data.ink_symbol, and the checkpoint says so
    assert abs(stats["stroke_width"] - 2.3) < 0.6 and abs(np.log(stats["symbol_size"] / 31.0)) < 0.25


def test_train_on_an_hme100k_folder_and_predict_either_polarity(tmp_path, cache_dir):
    root = hme_folder(tmp_path / "hme")
    run = tmp_path / "run"
    run_train(
        ["data=images", f"data.root={root}", "data.valid_fraction=0.3", "data.test=test"], run, cache_dir
    )
    assert (run / "metrics.json").is_file()
    dark = tmp_path / "dark.png"
    picture("1 + 2", 30, dark_on_light=True).save(dark)
    bright = tmp_path / "bright.png"
    Image.fromarray(255 - np.asarray(Image.open(dark))).save(bright)
    proc = python_run(
        [
            sys.executable,
            "-m",
            "wapstable.cli.predict",
            str(run / "checkpoints" / "last.pt"),
            str(dark),
            str(bright),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    readings = [line.split("\t", 1)[1] for line in proc.stdout.strip().splitlines()]
    assert len(readings) == 2 and readings[0] == readings[1]
    from wapstable.eval.evaluation import load_model, prepare_image, read_image

    model, _, _ = load_model(run / "checkpoints" / "last.pt")
    a = prepare_image(read_image(dark), ink=model.ink_stats)
    b = prepare_image(read_image(bright), ink=model.ink_stats)
    assert np.array_equal(a, b)


def test_images_refusals(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = run_train(["data=images", f"data.root={tmp_path}"], run, cache_dir, check=False)
    assert proc.returncode == 2 and "finds no captions file and image folder" in proc.stdout + proc.stderr
    assert not (run / "checkpoints").exists()
    # the others in this process
    root = comer_folder(tmp_path / "comer", splits=("train",))
    (root / "train" / "img" / "train_0.bmp").write_bytes(b"\x00")
    args = ["data=images", f"data.root={root}", "data.on_error=fail", "data.valid_fraction=0.3"]
    said = refusal_in_process(args, run, cache_dir)
    assert "train_0.bmp" in said and "data.on_error=skip" in said
    assert "data.pixel_aug.scale" in refusal_in_process(["data.pixel_aug.scale=[1.5,1.0]"], run, cache_dir)


def test_evaluate_brings_wap_bitmaps_to_the_checkpoint_ink(tmp_path, cache_dir):
    """A model trained on bright 2-px ink reads 4-px, 1.5x larger bitmaps (the WAP authors' kind) as its own."""
    root = comer_folder(tmp_path / "comer")
    run = tmp_path / "run"
    run_train(
        ["data=images", f"data.root={root}", "data.valid_fraction=0.3", "data.test=2014"], run, cache_dir
    )
    from omegaconf import OmegaConf

    from wapstable.config import data_yaml
    from wapstable.data.batches import load_splits
    from wapstable.eval.evaluation import load_model

    model, _, _ = load_model(run / "checkpoints" / "last.pt")
    d = OmegaConf.merge(data_yaml("images"), {"root": str(root), "test": "2014", "cache_dir": str(cache_dir)})
    for s in load_splits(d, which=("test",), ink=model.ink_stats)["test"]:
        m = measure(s.image > 127)
        assert abs(m.stroke_width - model.ink_stats.stroke_width) < 0.8
    out = python_run(
        [
            sys.executable,
            "scripts/evaluate.py",
            str(run / "checkpoints" / "last.pt"),
            "data=images",
            f"data.root={root}",
            "data.test=2014",
            "--out",
            str(tmp_path / "e.json"),
        ],
        env={**os.environ, "WAPSTABLE_CACHE": str(cache_dir)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "e.json").read_text())["data"] == "images"
