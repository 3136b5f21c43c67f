"""Any image of handwriting brought to what a model was trained on: polarity, contrast, ink scale and pen width.

A model learns one pen and one scale of ink. Images from elsewhere (the WAP authors' bitmaps: white strokes 4 px
wide; a scan: dark ink on light paper, grey, blurred) are read as the model's own pixels only after this:

1. polarity and contrast: the background (the border's median) becomes 0 and the ink 255, then Otsu's threshold;
2. scale: the ink's typical symbol size (`measure`: the median extent of its connected components) is resampled to
   the size the model was trained on;
3. pen: the strokes are thinned to their skeleton and drawn again with the training pen's width.

The targets are an `InkStats` measured by the same `measure` on the training images (`training_stats`), which
every checkpoint records (`ink_stats`), so evaluate.py and predict.py bring an image to its own model's ink.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image
from scipy import ndimage as ndi
from skimage.filters import threshold_otsu
from skimage.morphology import skeletonize

from wapstable.errors import UserError

MARGIN = 4  # px of background around the ink, as the project's rasterisers keep
MIN_COMPONENT = (
    0.25  # components smaller than this share of the largest one's extent (dots, noise) are not symbols
)
SCALE_RANGE = (0.2, 5.0)  # a measured scale factor outside this is a mismeasure: the image keeps its size


class InkStats(NamedTuple):
    """What a model's ink looks like: the pen's width and a typical symbol's extent, both in px."""

    stroke_width: float
    symbol_size: float

    def as_dict(self) -> dict:
        return {"stroke_width": float(self.stroke_width), "symbol_size": float(self.symbol_size)}

    @classmethod
    def from_dict(cls, d) -> "InkStats | None":
        if not d:
            return None
        return cls(float(d["stroke_width"]), float(d["symbol_size"]))


def to_ink(image: np.ndarray, polarity: str = "auto") -> np.ndarray:
    """(H, W) bool ink of a grey or colour image of either polarity: the background (most of the border) is what
    the ink is not; the two are split at Otsu's threshold after the contrast is stretched. `polarity` "bright"
    takes the bright pixels as ink whatever the border holds."""
    a = np.asarray(image)
    if a.ndim == 3:  # colour (H, W, 3|4) -> luminance
        a = np.asarray(Image.fromarray(a[..., :3].astype(np.uint8)).convert("L"))
    a = a.astype(np.float32)
    border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    if (
        polarity == "auto" and np.median(border) > (a.min() + a.max()) / 2
    ):  # light paper: dark ink becomes bright
        a = a.max() - a
    lo, hi = np.percentile(a, 1), a.max()
    if hi - lo < 1e-6:
        return np.zeros(a.shape, bool)
    a = (a - lo) / (hi - lo)
    try:
        t = threshold_otsu(a)
    except ValueError:  # a single grey level
        t = 0.5
    return a > max(t, 0.2)  # a faint page (all background) keeps no noise as ink


def _components(ink: np.ndarray) -> list[int]:
    """Extents (the longer side, px) of the 8-connected components that are symbols, not dots."""
    labels, n = ndi.label(ink, structure=np.ones((3, 3), bool))
    if n == 0:
        return []
    extents = [max(s[0].stop - s[0].start, s[1].stop - s[1].start) for s in ndi.find_objects(labels)]
    floor = MIN_COMPONENT * max(extents)
    return [e for e in extents if e >= floor]


def measure(ink: np.ndarray) -> InkStats | None:
    """The pen width (ink area over skeleton length) and typical symbol size (median component extent) of bool ink,
    or None when there is no ink to measure."""
    if not ink.any():
        return None
    skeleton = skeletonize(ink)
    length = max(int(skeleton.sum()), 1)
    extents = _components(ink)
    return InkStats(float(ink.sum()) / length, float(np.median(extents)))


def training_stats(images: Sequence[np.ndarray], limit: int = 300) -> InkStats | None:
    """The median ink statistics of (up to `limit`, evenly spread) training images: the targets of `normalize`."""
    if not images:
        return None
    step = max(1, len(images) // limit)
    measured = [m for m in (measure(to_ink(im)) for im in images[::step][:limit]) if m is not None]
    if not measured:
        return None
    return InkStats(
        float(np.median([m.stroke_width for m in measured])),
        float(np.median([m.symbol_size for m in measured])),
    )


def _pen(width: float) -> np.ndarray:
    """A round footprint that draws a stroke `width` px wide (2: a 2x2 square, as a 2-px line of the rasteriser)."""
    k = max(1, round(width))
    c = (k - 1) / 2
    yy, xx = np.mgrid[:k, :k]
    return (yy - c) ** 2 + (xx - c) ** 2 <= (k / 2) ** 2 + 1e-6


def core(stats: InkStats) -> float:
    """A symbol's extent without its pen: what resampling scales (a thicker pen adds its width to every extent)."""
    return stats.symbol_size - stats.stroke_width


def pen_width(stats: InkStats) -> float:
    """The width a stroke is drawn with so that `measure` reads `stats.stroke_width` again: the measure reads a
    k-px pen as about k (area over skeleton length), so the width is the measure, at least 1 px."""
    return max(1.0, stats.stroke_width)


def normalize(
    image: np.ndarray, target: InkStats | None, max_height: int = 0, polarity: str = "auto"
) -> np.ndarray:
    """`image` as the model's own pixels: (H, W) uint8, ink 255 on 0, the ink cropped with a MARGIN px border,
    resampled so that its typical symbol is `target.symbol_size` px and redrawn with the training pen. Without a
    target only polarity and contrast change. `max_height` > 0 shrinks taller results to fit; `polarity` as to_ink's."""
    ink = to_ink(image, polarity)
    if not ink.any():
        return np.zeros((2 * MARGIN + 1, 2 * MARGIN + 1), np.uint8)
    rows, cols = np.flatnonzero(ink.any(1)), np.flatnonzero(ink.any(0))
    ink = ink[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    if target is not None:
        found = measure(ink)
        factor = core(target) / core(found) if found and core(found) > 0 else 1.0
        if not SCALE_RANGE[0] <= factor <= SCALE_RANGE[1]:
            factor = 1.0
        h, w = ink.shape
        if max_height > 0 and h * factor > max_height - 2 * MARGIN:
            factor = (max_height - 2 * MARGIN) / h
        size = (max(1, round(w * factor)), max(1, round(h * factor)))
        pen = pen_width(target)
        # drawn first with the pen that the resampling brings to the target's, so thin strokes survive a shrink
        ink = ndi.binary_dilation(skeletonize(ink), structure=_pen(max(1.0, pen / factor)))
        grey = Image.fromarray(ink.astype(np.uint8) * 255).resize(size, Image.Resampling.BILINEAR)
        ink = np.asarray(grey) >= 128
        if ink.any():  # the skeleton drawn again with the training pen
            ink = ndi.binary_dilation(skeletonize(ink), structure=_pen(pen))
    out = np.zeros((ink.shape[0] + 2 * MARGIN, ink.shape[1] + 2 * MARGIN), np.uint8)
    out[MARGIN : MARGIN + ink.shape[0], MARGIN : MARGIN + ink.shape[1]] = ink.astype(np.uint8) * 255
    return out


def read_image(path: str | Path) -> np.ndarray:
    """An image file (PNG, JPG, ... as Pillow reads it) as (H, W) uint8 gray, transparency flattened onto white."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                im = im.convert("RGBA")
                white = Image.new("RGBA", im.size, (255, 255, 255, 255))
                im = Image.alpha_composite(white, im)  # dark ink on a transparent sheet is dark ink on white
            return np.asarray(im.convert("L"), dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise UserError(f"{path} is not a readable image ({e})") from None
