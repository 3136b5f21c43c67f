"""Attention guidance: where each token is (the renderer's symbol boxes, through crop and augmentation, cached
with the images, in the batches), the guide loss on the annotation grid, its weight schedule, and the guide in a
training step: off it changes nothing, on it is part of the guarded loss and is logged."""

import csv
import logging
import math

import numpy as np
import pytest
import torch
from conftest import TINY, compose_config, vgg

from wapstable.config import AttentionConfig, GuideConfig, ModelConfig
from wapstable.data import latex
from wapstable.data.batches import Batch, collate
from wapstable.data.render import grammar, mathtext, token_boxes
from wapstable.data.sample import Sample
from wapstable.data.sources import synthetic
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError
from wapstable.model.loss import forward_loss, guide_loss, guide_targets, guide_weight, sequence_loss
from wapstable.model.wap import build_model
from wapstable.train.build import validate_config

FRAC = ["\\frac", "{", "a", "+", "1", "}", "{", "\\sqrt", "{", "x", "}", "}", "=", "y", "_", "{", "i", "}", "^",
        "{", "2", "}"]  # fmt: skip
SUM = ["\\sum", "_", "{", "i", "=", "1", "}", "^", "{", "n", "}", "\\alpha", "-", "\\{", "b", "\\}"]


def boxes_of(tokens, font="cm", size=28, rng=None, augment=False):
    return mathtext.render_boxes(tokens, font, size, rng, augment)


def centre(box):
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def uncovered(img, boxes, level=128):
    """The ink pixels (>= level) outside every box."""
    inside = np.zeros(img.shape, bool)
    for x0, y0, x1, y1 in boxes[np.isfinite(boxes).all(1)]:
        inside[math.floor(y0) : math.ceil(y1), math.floor(x0) : math.ceil(x1)] = True
    return (img >= level) & ~inside


def ink_covered(img, boxes, level=128):
    """The share of the image's ink pixels (>= level) inside some box."""
    return 1 - uncovered(img, boxes, level).sum() / (img >= level).sum()


# -----------------------------------------------------------------------------
# where each token is


@pytest.mark.parametrize("font", mathtext.FONTS)
def test_every_symbol_gets_the_box_of_its_own_ink(font):
    for tokens in (FRAC, SUM):
        img, boxes = boxes_of(tokens, font)
        assert img.tobytes() == mathtext.render(tokens, font, 28, None, False).tobytes()  # same pixels
        assert boxes.shape == (len(tokens), 4) and boxes.dtype == np.float32
        for tok, box in zip(tokens, boxes):
            assert np.isnan(box).all() == (tok in latex.INKLESS), (tok, box)
            if tok not in latex.INKLESS:
                x0, y0, x1, y1 = box.astype(int)
                assert 0 <= x0 < x1 <= img.shape[1] and 0 <= y0 < y1 <= img.shape[0], (tok, box)
                assert img[y0:y1, x0:x1].max() >= 128, tok  # each box holds ink
    img, boxes = boxes_of(SUM, font)
    assert ink_covered(img, boxes) == 1.0  # every ink pixel is in a box
    img, boxes = boxes_of(FRAC, font)
    ys, xs = np.nonzero(uncovered(img, boxes))  # at most the root's bar, which no token's box holds
    assert not ys.size or ys.max() < boxes[9][1] and xs.min() >= boxes[7][0]
    b = dict(zip(range(len(FRAC)), boxes))
    bar, a, x, radical = b[0], b[2], b[9], b[7]
    assert bar[3] - bar[1] <= 4 and bar[2] - bar[0] > 2 * (a[2] - a[0])  # a thin, wide fraction bar
    assert a[3] <= bar[1] + 1 <= x[1] + 1  # numerator above the bar, radicand below it
    assert radical[0] < x[0] and radical[2] <= x[2]  # the root's sign, left of its radicand, not its bar
    y, i, two = (
        b[13],
        b[16],
        b[20],
    )  # y_{i}^{2}: mathtext sets the superscript first, the boxes still follow tokens
    assert centre(two)[1] < centre(y)[1] < centre(i)[1] and min(two[0], i[0]) >= y[0]
    img, boxes = boxes_of(SUM, font)
    total, i, n = boxes[0], boxes[3], boxes[9]  # \sum_{i=1}^{n}: n above the sign, i below
    assert n[3] <= centre(total)[1] <= i[1]
    xs = [centre(boxes[k])[0] for k in (11, 12, 13, 14, 15)]  # \alpha - \{ b \}: left to right
    assert xs == sorted(xs)


def test_boxes_follow_the_augmentation_and_leave_the_pixels_alone():
    for seed, tokens in enumerate([SUM, SUM[11:]] * 3):
        font = mathtext.FONTS[seed % len(mathtext.FONTS)]
        img, boxes = boxes_of(tokens, font, rng=np.random.default_rng(seed), augment=True)
        same = mathtext.render(tokens, font, 28, np.random.default_rng(seed), True)
        assert img.tobytes() == same.tobytes() and img.shape == same.shape
        plain_img, plain = boxes_of(tokens, font)
        assert (np.isnan(boxes) == np.isnan(plain)).all()  # no box lost in the warp
        # Bent, the ink stays in its boxes; the straight boxes of the unbent image would miss much of it.
        assert ink_covered(img, boxes) > 0.97, seed
        for tok, box in zip(tokens, boxes):
            if tok not in latex.INKLESS:
                x0, y0, x1, y1 = box.astype(int)
                assert img[y0:y1, x0:x1].max() >= 64, (seed, tok)


def test_every_label_of_the_grammar_gets_its_boxes():
    exprs = grammar.generate_expressions(40, seed=3, difficulty=3)
    for k, tokens in enumerate(exprs):
        _, boxes = boxes_of(tokens, mathtext.FONTS[k % len(mathtext.FONTS)], size=16)
        inked = np.array([t not in latex.INKLESS for t in tokens])
        assert (np.isfinite(boxes).all(1) == inked).all(), tokens


def test_a_layout_that_does_not_match_its_tokens_gives_no_boxes():
    _, boxes = boxes_of(["x", "+", "y"])
    assert np.isfinite(boxes).all()
    items = [(0, "g", (0, 0, 5, 5), "x"), (1, "g", (6, 0, 9, 5), "+")]  # one glyph short
    assert token_boxes.token_boxes(["x", "+", "y"], items, np.ones((9, 9), np.uint8)) is None
    items.append((2, "g", (10, 0, 14, 5), "z"))  # a glyph that is not the token's
    assert token_boxes.token_boxes(["x", "+", "y"], items, np.ones((9, 20), np.uint8)) is None


def test_boxes_are_cached_with_the_images(tmp_path, monkeypatch):
    cfg = dict(
        num_train=6, num_valid=2, num_test=2, difficulty=2, fonts=["cm", "stix"], font_size=16, augment=True,
        seed=0, render_workers=1, cache_dir=str(tmp_path),
    )  # fmt: skip
    from types import SimpleNamespace

    first = synthetic.build_splits(SimpleNamespace(**cfg))

    def no_render(*args, **kwargs):
        raise AssertionError("rendered although the cache holds these splits and their boxes")

    monkeypatch.setattr(synthetic, "render", no_render)
    again = synthetic.build_splits(SimpleNamespace(**cfg))  # from the .npz
    assert (
        synthetic.cache_params(SimpleNamespace(**cfg))["format"] == 2
    )  # a new key: old caches are not misread
    for split in synthetic.SPLITS:
        for a, b in zip(first[split], again[split]):
            assert a.boxes.shape == (len(a.tokens), 4)
            np.testing.assert_array_equal(a.boxes, b.boxes)
            assert a.image.tobytes() == b.image.tobytes()
            assert np.isfinite(a.boxes).all(1).sum() == sum(t not in latex.INKLESS for t in a.tokens)


def test_collate_puts_each_tokens_box_beside_it():
    tokens = [["x", "^", "{", "2", "}"], ["a"]]
    boxes = [np.array([[1, 2, 5, 9], [np.nan] * 4, [np.nan] * 4, [6, 0, 9, 4], [np.nan] * 4], np.float32),
             np.array([[0, 0, 3, 3]], np.float32)]  # fmt: skip
    vocab = Vocab.build(tokens)
    samples = [Sample("a", np.ones((10, 12), np.uint8), tokens[0], boxes[0]),
               Sample("b", np.ones((4, 4), np.uint8), tokens[1], boxes[1])]  # fmt: skip
    batch = collate(samples, vocab)
    assert batch.regions.shape == (2, 6, 4)
    np.testing.assert_array_equal(batch.regions[0, :5].numpy(), boxes[0])
    np.testing.assert_array_equal(batch.regions[1, 0].numpy(), boxes[1][0])
    assert (
        torch.isnan(batch.regions[0, 5]).all() and torch.isnan(batch.regions[1, 1:]).all()
    )  # <eol>, padding
    assert batch.to(torch.device("cpu")).regions is not None
    plain = collate([s._replace(boxes=None) for s in samples], vocab)
    assert plain.regions is None
    for a, b in zip(plain[:4], batch[:4]):
        assert torch.equal(a, b)


# -----------------------------------------------------------------------------
# the guide loss


def test_guide_targets_are_the_boxes_share_of_each_cell():
    regions = torch.tensor([[[4.0, 0.0, 20.0, 8.0], [float("nan")] * 4]])
    area = guide_targets(regions, (2, 3), stride=16)
    assert area.shape == (1, 2, 2, 3)
    expected = torch.tensor([[12.0 * 8, 4.0 * 8, 0], [0, 0, 0]])  # x 4..16 and 16..20 of the first row
    torch.testing.assert_close(area[0, 0], expected)
    assert area[0, 1].sum() == 0


def test_guide_loss_is_low_on_the_box_and_high_off_it():
    regions = torch.tensor([[[0.0, 0.0, 16.0, 16.0], [32.0, 16.0, 48.0, 32.0], [float("nan")] * 4]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    on = torch.zeros(1, 3, 2, 3)
    on[0, 0, 0, 0] = on[0, 1, 1, 2] = 1.0
    on[0, 2, 0, 1] = 1.0  # the token without a box looks anywhere
    off = torch.roll(on, 1, dims=-1)
    for kind in ("inside", "kl"):
        assert guide_loss(on, regions, mask, 16, kind) < 1e-4
        assert guide_loss(off, regions, mask, 16, kind) > 2 * 13  # about -log(1e-6) per token
        # a token past the label's end or without a box adds nothing
        assert guide_loss(off, regions, torch.tensor([[1.0, 0.0, 1.0]]), 16, kind) < guide_loss(
            off, regions, mask, 16, kind
        )
    energy = torch.zeros(1, 3, 2, 3, requires_grad=True)
    alpha = torch.softmax(energy.flatten(2), -1).view_as(energy)
    guide_loss(alpha, regions, mask, 16).backward()
    assert energy.grad[0, 0, 0, 0] < 0 and energy.grad[0, 1, 1, 2] < 0  # descent raises attention on the box
    assert (energy.grad[0, 2] == 0).all()
    with pytest.raises(ValueError, match="model.attention.guide.kind"):
        guide_loss(on, regions, mask, 16, "bogus")


def test_guide_weight_fades_as_configured():
    assert guide_weight(None, 5) == 0.0
    g = dict(weight=2.0, kind="inside", fade_start=100, fade_end=300)
    assert [guide_weight(g, s) for s in (0, 100, 200, 300, 1000)] == [2.0, 2.0, 1.0, 0.0, 0.0]
    assert guide_weight({**g, "fade_start": 0, "fade_end": 0}, 10**6) == 2.0


# -----------------------------------------------------------------------------
# the guide in training


V = 12


def tiny_model(weight=0.0, **guide):
    torch.manual_seed(0)
    cfg = ModelConfig(
        watcher=vgg([4, 8, 8, 8], convs_per_block=1),
        embed_dim=8,
        hidden_dim=16,
        attention=AttentionConfig(
            dim=8,
            coverage_channels=4,
            coverage_kernel=3,
            position_features=8,
            guide=GuideConfig(weight, **guide),
        ),
    )
    return build_model(cfg, V)


def tiny_batch():
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 1, 40, 70, generator=g)
    image_mask = torch.ones(2, 40, 70)
    image_mask[1, :, 50:] = 0
    targets = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]])
    target_mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    regions = torch.full((2, 4, 4), float("nan"))
    regions[0, 0], regions[0, 2], regions[1, 1] = (
        torch.tensor([2.0, 2, 14, 30]),
        torch.tensor([40.0, 10, 60, 20]),
        torch.tensor([20.0, 5, 30, 35]),
    )
    return Batch(images, image_mask, targets, target_mask, ["a", "b"], regions)


def test_guide_off_leaves_the_loss_bit_for_bit():
    batch = tiny_batch()
    off = tiny_model()
    assert off.guide is None
    reference = sequence_loss(
        off(batch.images, batch.image_mask, batch.targets), batch.targets, batch.target_mask
    )
    assert torch.equal(forward_loss(off, batch), reference)
    assert torch.equal(forward_loss(off, batch._replace(regions=None)), reference)
    assert off.guide_value is None
    on = tiny_model(1.5, fade_start=10, fade_end=20)
    on.load_state_dict(off.state_dict())
    assert torch.equal(forward_loss(on, batch, step=20), reference)  # faded out: the plain loss again
    assert torch.equal(
        forward_loss(on, batch._replace(regions=None), step=0), reference
    )  # data without boxes
    loss = forward_loss(on, batch, step=0)
    assert on.guide_value is not None and on.guide_value > 0
    torch.testing.assert_close(loss, reference + 1.5 * on.guide_value)
    torch.testing.assert_close(forward_loss(on, batch, step=15), reference + 0.75 * on.guide_value)


def test_guide_trains_the_attention_toward_the_boxes():
    model, batch = tiny_model(1.0), tiny_batch()
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    values = []
    for _ in range(30):
        opt.zero_grad()
        forward_loss(model, batch).backward()
        values.append(float(model.guide_value))
        opt.step()
    assert values[-1] < 0.3 * values[0], values


def test_a_skipped_step_skips_the_guide(monkeypatch):
    from wapstable.model import loss as loss_module
    from wapstable.stability.step_guard import Outcome, StepGuard

    model, batch = tiny_model(1.0), tiny_batch()
    guard = StepGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), clip="norm", max_norm=10.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(loss_module, "guide_loss", lambda *a, **k: torch.tensor(float("nan")))
    result = guard.step(forward_loss(model, batch, step=0))
    assert result.outcome is Outcome.NONFINITE  # the guide is inside the guarded loss
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    monkeypatch.undo()
    result = guard.step(forward_loss(model, batch, step=1))
    assert result.outcome is Outcome.ACCEPTED
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_guide_under_bf16_and_ddp(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, batch = tiny_model(1.0), tiny_batch()
    plain = forward_loss(model, batch, precision="bf16")
    assert torch.isfinite(plain) and torch.isfinite(model.guide_value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(model)
        loss = forward_loss(wrapped, batch)
        loss.backward()
        assert model.guide_value is not None
        torch.testing.assert_close(loss, forward_loss(model, batch))
        assert all(p.grad is not None for p in model.parser.attention.parameters())
    finally:
        dist.destroy_process_group()


def test_a_run_with_the_guide_logs_it_beside_the_loss(tmp_path, cache_dir):
    from wapstable.train.stages import train

    args = [*TINY, "trainer.max_steps=4", "trainer.eval_every=4", "trainer.checkpoint_every=4", "logger=csv",
            f"data.cache_dir={cache_dir}", "model.attention.guide.weight=1.0", "model.attention.guide.kind=kl",
            "trainer.precision=bf16"]  # fmt: skip
    metrics = train(compose_config(args, run_dir=tmp_path / "run"))
    assert metrics["steps"] == 4
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    values = [float(r["train/guide"]) for r in rows if r["train/guide"]]
    assert len(values) == 4 and all(math.isfinite(v) and v > 0 for v in values)
    assert {r["train/guide_weight"] for r in rows if r["train/guide_weight"]} == {"1.0"}
    assert all(r["train/loss"] for r in rows if r["train/guide"])  # beside the loss, step by step


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.attention.guide.weight=-1", "model.attention.guide.weight"),
        ("model.attention.guide.fade_start=-5", "model.attention.guide.fade_start"),
        ("model.attention.guide.fade_end=-1", "model.attention.guide.fade_end"),
        ("model.attention.guide.fade_end=10", "model.attention.guide.fade_end"),  # with fade_start=20
    ],
)
def test_wrong_guide_values_are_refused_naming_the_key(override, key):
    cfg = compose_config(["model.attention.guide.fade_start=20", override])
    if "fade_start=-5" in override:
        cfg.model.attention.guide.fade_end = 0
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        validate_config(cfg)


def test_the_guide_says_it_does_nothing_on_data_without_boxes_and_knows_its_kinds(caplog):
    from hydra.errors import ConfigCompositionException

    with caplog.at_level(logging.WARNING, logger="wapstable"):
        validate_config(compose_config(["data=wap_pkl", "model.attention.guide.weight=1"]))
    assert any("does nothing on data=wap_pkl" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wapstable"):
        validate_config(compose_config(["model.attention.guide.weight=1"]))
        validate_config(
            compose_config(["data=wap_pkl", "model.attention.guide.weight=0", "model.symbol_map=0"])
        )
    assert not caplog.records
    with pytest.raises(ConfigCompositionException):
        compose_config(["model.attention.guide.kind=bogus"])


def test_make_figures_draws_the_boxes(tmp_path):
    from PIL import Image

    from wapstable.cli import figures

    assert figures.main(["--only", "boxes", "--out", str(tmp_path)]) == 0
    with Image.open(tmp_path / "symbol-boxes.png") as im:
        assert im.format == "PNG" and im.size[0] >= 600


# -----------------------------------------------------------------------------
# CROHME: the traceGroups name each symbol's strokes

INKML = """<ink xmlns="http://www.w3.org/2003/InkML">
<annotation type="truth">$\\frac{a}{x^2}$</annotation>
<annotationXML type="truth" encoding="Content-MathML">
<math xmlns="http://www.w3.org/1998/Math/MathML">
<mfrac xml:id="bar"><mi xml:id="a">a</mi><msup><mi xml:id="x">x</mi><mn xml:id="two">2</mn></msup></mfrac>
</math></annotationXML>
<trace id="0">0 50, 100 50</trace>
<trace id="1">40 0, 60 0, 60 30, 40 30</trace>
<trace id="2">20 60, 50 100</trace>
<trace id="3">50 60, 20 100</trace>
<trace id="4">70 55, 90 55, 90 70</trace>
<traceGroup xml:id="seg"><annotation type="truth">Segmentation</annotation>
<traceGroup xml:id="g0"><annotation type="truth">a</annotation><traceView traceDataRef="1"/><annotationXML href="a"/></traceGroup>
<traceGroup xml:id="g1"><annotation type="truth">-</annotation><traceView traceDataRef="0"/><annotationXML href="bar"/></traceGroup>
<traceGroup xml:id="g2"><annotation type="truth">x</annotation><traceView traceDataRef="2"/><traceView traceDataRef="3"/><annotationXML href="x"/></traceGroup>
<traceGroup xml:id="g3"><annotation type="truth">2</annotation><traceView traceDataRef="4"/><annotationXML href="two"/></traceGroup>
</traceGroup></ink>"""


def test_crohme_boxes_follow_a_redrawing(tmp_path):
    """data.redraw moves every symbol on its own: each symbol's box moves with its strokes."""
    from wapstable.data.ink.raster import Raster
    from wapstable.data.ink.read import read_inkml
    from wapstable.data.ink.redraw import Redraw

    path = tmp_path / "expr.inkml"
    path.write_text(INKML)
    raster = Raster(height=64, line_width=2)
    plain = read_inkml(path, raster)
    for index in (1, 2, 3):
        s = read_inkml(path, raster, Redraw(index))
        assert s.id == f"expr~{index}" and s.tokens == plain.tokens
        assert not np.allclose(s.boxes[0], plain.boxes[0], atol=0.5) or s.image.shape != plain.image.shape
        assert ink_covered(s.image, s.boxes) > 0.99
        for box in s.boxes[np.isfinite(s.boxes).all(1)]:
            x0, y0, x1, y1 = box.astype(int)
            assert s.image[y0:y1, x0:x1].max() == 255


def test_crohme_boxes_come_from_the_trace_groups(tmp_path):
    from wapstable.data.ink.raster import Raster
    from wapstable.data.ink.read import read_inkml
    from wapstable.data.sources.crohme import read_folder

    path = tmp_path / "f" / "expr.inkml"
    path.parent.mkdir()
    path.write_text(INKML)
    s = read_inkml(path, Raster(height=64, line_width=2))
    assert s.tokens == ["\\frac", "{", "a", "}", "{", "x", "^", "{", "2", "}", "}"]
    b = {tok: box for tok, box in zip(s.tokens, s.boxes) if np.isfinite(box).all()}
    assert set(b) == {"\\frac", "a", "x", "2"}
    assert np.isnan(s.boxes[[1, 3, 4, 6, 7, 9, 10]]).all()
    h, w = s.image.shape
    bar, a, x, two = b["\\frac"], b["a"], b["x"], b["2"]
    assert bar[0] <= 4 and bar[2] >= w - 5 and bar[3] - bar[1] <= 5  # the bar spans the image, thin
    assert (
        a[3] < bar[1] + 1 < x[1] and two[2] > x[2] and two[1] < x[1]
    )  # numerator above, 2 raised right of x
    assert ink_covered(s.image, s.boxes) > 0.99
    for box in s.boxes[np.isfinite(s.boxes).all(1)]:
        x0, y0, x1, y1 = box.astype(int)
        assert s.image[y0:y1, x0:x1].max() == 255
    # cached with the pixels
    first = read_folder(path.parent, Raster(height=64, line_width=2), tmp_path / "cache").samples[0]
    again = read_folder(path.parent, Raster(height=64, line_width=2), tmp_path / "cache").samples[0]
    np.testing.assert_array_equal(first.boxes, again.boxes)
    # symbols that do not match the label: no boxes at all rather than wrong ones
    path.write_text(
        INKML.replace('<annotation type="truth">x</annotation>', '<annotation type="truth">y</annotation>')
    )
    assert read_inkml(path, Raster()).boxes is None
    path.write_text(INKML.replace("<traceGroup", "<traceGroupX").replace("</traceGroup>", "</traceGroupX>"))
    plain = read_inkml(path, Raster(height=64, line_width=2))
    assert plain.boxes is None and plain.image.tobytes() == s.image.tobytes()
