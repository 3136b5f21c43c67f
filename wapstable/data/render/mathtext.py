"""Printed expressions: a token list rendered by matplotlib's mathtext through Agg straight into memory, and
torchvision's v2 kernels bending the result a little so it looks less typeset (data.augment).

Inside `collect_boxes()` every render() also finds where each token is drawn (token_boxes, from the layout that
glyph_hook records) and moves those boxes through the same crops and warps as the pixels.
"""

import logging
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.font_manager import FontProperties

from wapstable.data.render.glyph_hook import laid_out_source
from wapstable.data.render.token_boxes import token_boxes
from wapstable.data.sample import no_boxes

MARGIN = 4  # px of background kept around the ink
FONTS = ("cm", "stix", "stixsans", "dejavuserif", "dejavusans")


def tokens_to_mathtext(tokens: list[str]) -> str:
    """The mathtext source ("$...$") that renders `tokens`."""
    # Mathtext does not ignore blanks: `x ^ {2}` sets the 2 full size. So tokens are glued, with a blank only
    # where a command word would otherwise swallow the next letter (`\pi x`, not `\pix`).
    parts = []
    tokens = [t for t in tokens if t != "\\limits"]  # mathtext sets \lim's and \sum's limits below anyway
    for prev, tok in zip([""] + tokens[:-1], tokens):
        if prev[:1] == "\\" and prev[1:].isalpha() and tok[:1].isalpha():
            parts.append(" ")
        parts.append(tok)
    return "$" + "".join(parts) + "$"


class _QuietGlue(logging.Filter):
    """Drops mathtext's "Underful Vlist" dumps (a root over a script holding a fraction): the image is fine; and its
    notes that a font set borrows a glyph from another (\\cdots in cm), once per image."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Substituting symbol"):
            return False
        return not (isinstance(record.args, tuple) and record.args[:1] in (("Underful",), ("Overful",)))


logging.getLogger("matplotlib.mathtext").addFilter(_QuietGlue())


@lru_cache(maxsize=64)
def font_properties(font: str, font_size: int) -> FontProperties:
    return FontProperties(size=font_size, math_fontfamily=font)


def _crop(img: np.ndarray, margin: int = MARGIN, boxes: np.ndarray | None = None):
    """The image cropped to its ink plus `margin`; with `boxes` (K, 4), also the boxes moved along with it."""
    rows, cols = np.flatnonzero(img.any(1)), np.flatnonzero(img.any(0))
    top = left = 0
    if rows.size:
        top, left = int(rows[0]), int(cols[0])
        img = img[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    img = np.pad(img, margin)
    if boxes is None:
        return img
    return img, boxes + np.array([margin - left, margin - top] * 2, np.float32)


def _smooth_field(rng: np.random.Generator, h: int, w: int, sigma: float) -> torch.Tensor:
    # Uniform noise blurred by a Gaussian is smooth on the scale of sigma, so it is drawn and blurred on a grid
    # 4x coarser and upsampled: the same kind of field for a small fraction of the convolution cost. Averaging
    # 4x fewer samples leaves it 4x stronger, hence the division, which keeps torchvision's meaning of alpha.
    step = 4
    s = sigma / step
    k = int(8 * s + 1) | 1
    noise = torch.from_numpy(rng.random((2, 1, h // step + 2, w // step + 2), dtype=np.float32) * 2 - 1)
    t = torch.arange(k, dtype=torch.float32) - k // 2
    g = torch.exp(-0.5 * (t / s) ** 2)
    g = g / g.sum()
    noise = F.pad(noise, (k // 2, k // 2, k // 2, k // 2), mode="replicate")
    noise = F.conv2d(F.conv2d(noise, g.view(1, 1, k, 1)), g.view(1, 1, 1, k))
    return F.interpolate(noise, size=(h, w), mode="bilinear", align_corners=True)[:, 0] / step


def _box_masks(boxes: np.ndarray, h: int, w: int) -> torch.Tensor:
    """(K, h, w) float masks, 1 on the pixels each box (x0, y0, x1, y1, edges in pixels) covers."""
    ys = torch.arange(h, dtype=torch.float32)[None, :, None] + 0.5
    xs = torch.arange(w, dtype=torch.float32)[None, None, :] + 0.5
    b = torch.from_numpy(np.nan_to_num(boxes, nan=-1.0).astype(np.float32))[:, :, None, None]
    inside = (xs >= b[:, 0]) & (xs < b[:, 2]) & (ys >= b[:, 1]) & (ys < b[:, 3])
    return inside.float()


def _mask_boxes(masks: torch.Tensor, boxes: np.ndarray) -> np.ndarray:
    """The boxes enclosing each warped mask (K, h, w) where it is at least 0.3; NaN where a mask vanished or the
    box had none to begin with."""
    out = np.full((len(masks), 4), np.nan, np.float32)
    on = masks >= 0.3
    rows, cols = on.any(2), on.any(1)  # (K, h), (K, w)
    for k in range(len(masks)):
        r, c = torch.nonzero(rows[k]).flatten(), torch.nonzero(cols[k]).flatten()
        if r.numel() and not np.isnan(boxes[k, 0]):
            out[k] = (int(c[0]), int(r[0]), int(c[-1]) + 1, int(r[-1]) + 1)
    return out


def _augment(img: np.ndarray, rng: np.random.Generator, boxes: np.ndarray | None = None):
    """The image bent by `rng` (affine, elastic, blur); with `boxes` (K, 4), also the boxes bent alike: each box's
    filled rectangle is warped by the very same affine and elastic grids as the pixels, and the box enclosing the
    warped rectangle is kept (so the elastic part is exact at the box's pixels, not only at its corners). The
    random draws are the same with and without boxes, so the image is too."""
    # Every parameter comes from `rng` rather than torch's global generator, so an image depends only on its
    # own seed: no fork_rng, no state leaking between samples or workers.
    # torchvision is imported here, not at the top: its import takes 1.5 s (it loads torch._dynamo), and a run whose
    # data is cached never augments.
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    h, w = img.shape
    pad = 8 + int(0.12 * max(h, w))  # room for the ends of a wide line to rotate and shear into
    x = torch.from_numpy(np.pad(img, pad).astype(np.float32))[None]
    masks = None
    if boxes is not None and len(boxes):
        masks = _box_masks(boxes + pad, *x.shape[-2:])
    affine = dict(
        angle=float(rng.uniform(-3.0, 3.0)),
        translate=[0.0, 0.0],
        scale=float(rng.uniform(0.9, 1.1)),
        shear=[float(rng.uniform(-12.0, 12.0)), float(rng.uniform(-3.0, 3.0))],
        interpolation=InterpolationMode.BILINEAR,
    )
    x = TF.affine(x, **affine)
    if masks is not None:
        masks = TF.affine(masks, **affine)
    if rng.random() < 0.7:
        # torchvision's ElasticTransform: a smooth random field, scaled by alpha, in grid units of [-1, 1]
        hh, ww = x.shape[-2:]
        alpha, sigma = float(rng.uniform(15.0, 40.0)), float(rng.uniform(3.0, 5.0))
        d = _smooth_field(rng, hh, ww, sigma)
        displacement = torch.stack([d[0] * (alpha / ww), d[1] * (alpha / hh)], dim=-1)[None]
        x = TF.elastic(x, displacement, interpolation=InterpolationMode.BILINEAR)
        if masks is not None:
            masks = TF.elastic(masks, displacement, interpolation=InterpolationMode.BILINEAR)
    if rng.random() < 0.3:
        s = float(rng.uniform(0.3, 0.8))
        x = TF.gaussian_blur(x, [3, 3], [s, s])
    out = x[0].round_().clamp_(0, 255).to(torch.uint8).numpy()
    out[out < 8] = 0  # faint interpolation dust would otherwise widen the crop
    if boxes is None:
        return out
    return out, (_mask_boxes(masks, boxes) if masks is not None else boxes.copy())


class BoxSink(list):
    """The token boxes of every render() inside collect_boxes(), one (len(tokens), 4) array per image, and how many
    of those layouts could not be matched to their tokens (`failures`: their boxes are all NaN)."""

    failures = 0


# The sink of the innermost collect_boxes(), None outside: render() computes boxes only when someone collects them.
_sink: BoxSink | None = None


@contextmanager
def collect_boxes():
    """Inside, every render() also computes the boxes of its tokens and appends them to the yielded BoxSink."""
    global _sink
    before, _sink = _sink, BoxSink()
    try:
        yield _sink
    finally:
        _sink = before


def laid_out(tokens: list[str], font: str, font_size: int, record: bool) -> tuple[np.ndarray, list]:
    """Mathtext's image of `tokens` and, with `record`, the glyphs and rules of its layout (glyph_hook)."""
    return laid_out_source(tokens_to_mathtext(tokens), font_properties(font, font_size), record)


def _parse(
    tokens: list[str], font: str, font_size: int, record: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    if not record:
        return laid_out(tokens, font, font_size, record=False)[0], None
    try:
        img, items = laid_out(tokens, font, font_size, record=True)
        boxes = token_boxes(tokens, items, img)
    except AttributeError:  # a matplotlib whose mathtext internals differ: the image, without boxes
        img, boxes = _parse(tokens, font, font_size, record=False)[0], None
    if boxes is None:
        _sink.failures += 1
        boxes = no_boxes(len(tokens))
    return img, boxes


def render(
    tokens: list[str], font: str, font_size: int, rng: np.random.Generator | None, augment: bool
) -> np.ndarray:
    """A (H, W) uint8 image of `tokens`, ink 255 on 0, cropped to the ink plus a small margin.

    `font` is a mathtext font set (cm, stix, stixsans, dejavuserif, dejavusans). With `augment`, the image is
    randomly bent by `rng` (None = a fresh unseeded generator, for previews). Inside `collect_boxes()` the
    boxes of the tokens (render_boxes) are computed too, moved through the same crops and warps; the image is the
    same either way.
    """
    img, boxes = _parse(tokens, font, font_size, record=_sink is not None)
    if augment:
        rng = rng if rng is not None else np.random.default_rng()
        if boxes is None:
            img = _augment(_crop(img, 0), rng)
        else:
            img, boxes = _crop(img, 0, boxes)
            img, boxes = _augment(img, rng, boxes)
    if boxes is None:
        return _crop(img)
    img, boxes = _crop(img, MARGIN, boxes)
    _sink.append(boxes)
    return img


def render_boxes(
    tokens: list[str], font: str, font_size: int, rng: np.random.Generator | None, augment: bool
) -> tuple[np.ndarray, np.ndarray]:
    """render()'s image and its tokens' boxes (len(tokens), 4): x0, y0, x1, y1 in pixels (x1, y1 exclusive),
    NaN rows for tokens without ink of their own ({, }, ^, _) or when the layout could not be matched."""
    with collect_boxes() as sink:
        img = render(tokens, font, font_size, rng, augment)
    return img, sink[0]
