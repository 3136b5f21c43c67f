"""Any image of handwriting brought to what a model was trained on: polarity, contrast, ink scale and pen width.

A model learns one pen and one scale of ink. Images from elsewhere (the WAP authors' bitmaps: white strokes 4 px
wide; a scan: dark ink on light paper, grey, blurred) are read as the model's own pixels only after this:

1. polarity and contrast: the background (the border's median) becomes 0 and the ink 255, then Otsu's threshold;
2. scale: the ink's typical symbol size (`measure`: the median extent of its connected components) is resampled to
   the size the model was trained on;
3. pen: the strokes are thinned to their skeleton and drawn again with the training pen's width.

The targets are an `InkStats` measured by the same `measure` on the training images (`training_stats`), which
every checkpoint records (`ink_stats`), so evaluate.py and predict.py bring an image to its own model's ink.

Steps 2 and 3 change pixels the model may read well as they are: resampling blurs, and a redrawn skeleton loses a
stroke's shape. So a target also records the range of sizes and pens the model saw in training (the spread of its
training images, widened by data.pixel_aug's scale and pen, or by the scales it reads well: `read_factors`, measured
at the end of training with data.read_range), and an image inside that range keeps its size or its pen. Measured on
the WAP authors' 2014 bitmaps with an augmented CROHME model (docs/studies/images.md): resampling and redrawing them
read 17.2 % (greedy), leaving them as they are 22.0 %.
"""

from collections.abc import Callable, Sequence
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
    """What a model's ink looks like: the pen's width and a typical symbol's extent, both in px, and the ranges of
    each that it saw in training, or reads ((lo, hi); None: only the value itself, so every image is brought to
    it): its training images' quartiles times the scale `factors` (lo, hi) (None: a checkpoint from before they
    were kept, whose factors are its data.pixel_aug.scale)."""

    stroke_width: float
    symbol_size: float
    stroke_range: tuple[float, float] | None = None
    symbol_range: tuple[float, float] | None = None
    factors: tuple[float, float] | None = None

    def as_dict(self) -> dict:
        d = {"stroke_width": float(self.stroke_width), "symbol_size": float(self.symbol_size)}
        for key in ("stroke_range", "symbol_range", "factors"):
            if getattr(self, key) is not None:
                d[key] = [float(v) for v in getattr(self, key)]
        return d

    @classmethod
    def from_dict(cls, d) -> "InkStats | None":
        if not d:
            return None
        spans = {
            k: (float(d[k][0]), float(d[k][1]))
            for k in ("stroke_range", "symbol_range", "factors")
            if d.get(k)
        }
        return cls(float(d["stroke_width"]), float(d["symbol_size"]), **spans)

    def rescaled(self, factors: tuple[float, float], before: tuple[float, float] = (1.0, 1.0)) -> "InkStats":
        """The same statistics with the ranges widened by the scale `factors` instead of by the ones they were
        widened by (`factors`, or `before` where they do not say: the checkpoint's data.pixel_aug.scale)."""
        was = self.factors or before
        lo, hi = float(factors[0]), float(factors[1])

        def span(r):
            return None if r is None else (r[0] / was[0] * lo, r[1] / was[1] * hi)

        return self._replace(
            stroke_range=span(self.stroke_range), symbol_range=span(self.symbol_range), factors=(lo, hi)
        )

    def __str__(self) -> str:
        def span(r):
            return f" ({r[0]:.1f} to {r[1]:.1f})" if r else ""

        return (
            f"a {self.stroke_width:.2f} px pen{span(self.stroke_range)}, "
            f"symbols {self.symbol_size:.1f} px{span(self.symbol_range)}"
        )


def _inside(value: float, span: tuple[float, float] | None) -> bool:
    return span is not None and span[0] <= value <= span[1]


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


def training_stats(
    images: Sequence[np.ndarray], limit: int = 300, scale=(1.0, 1.0), pen: bool = False
) -> InkStats | None:
    """The median ink statistics of (up to `limit`, evenly spread) training images, the targets of `normalize`,
    with the ranges the model saw: the middle half (quartiles) of the images, times data.pixel_aug's `scale`
    range, the pen 1 px thinner to 2 px thicker when `pen` (data.pixel_aug.pen > 0) thins and thickens strokes."""
    if not images:
        return None
    step = max(1, len(images) // limit)
    measured = [m for m in (measure(to_ink(im)) for im in images[::step][:limit]) if m is not None]
    if not measured:
        return None
    strokes = np.array([m.stroke_width for m in measured])
    symbols = np.array([m.symbol_size for m in measured])
    lo, hi = float(scale[0]), float(scale[1])
    s_lo, s_hi = (float(v) for v in np.percentile(strokes, [25, 75]))
    if pen:
        s_lo, s_hi = max(1.0, s_lo - 1.0), s_hi + 2.0
    y_lo, y_hi = (float(v) for v in np.percentile(symbols, [25, 75]))
    return InkStats(
        float(np.median(strokes)),
        float(np.median(symbols)),
        (s_lo * lo, s_hi * hi),
        (y_lo * lo, y_hi * hi),
        (lo, hi),
    )


def check_read_range(read_range) -> None:
    """data.read_range: factors in (0.25, 4], a tolerance >= 0 points; else one sentence naming the value."""
    scales = list(read_range.scales)
    if not all(0.25 < float(f) <= 4.0 for f in scales):  # NaN fails too
        raise UserError(
            f"data.read_range.scales={scales} must list factors in (0.25, 4], e.g. [0.7,0.85,1.2,1.4] ([] = the "
            "range shown in training is recorded)"
        )
    if not float(read_range.tolerance) >= 0:
        raise UserError(
            f"data.read_range.tolerance={read_range.tolerance} must be >= 0 (points of ExpRate below scale 1)"
        )


def readings_at(read: Callable[[float], float], scales: Sequence[float]) -> dict[float, float]:
    """`read(f)`, a split's ExpRate at scale factor f, at 1 and at each of `scales`, smallest factor first: the
    readings `read_factors` takes (train.py's data.read_range and evaluate.py's --read-range)."""
    return {f: read(f) for f in sorted({1.0, *scales})}


def read_factors(readings: dict[float, float], tolerance: float) -> tuple[float, float] | None:
    """The scale factors a model reads well, from `readings` (factor -> ExpRate, 1.0 among them): the smallest and
    the largest factor reached from 1 without passing one that reads more than `tolerance` points below 1's; None
    where it reads nothing at scale 1, which measures no range."""
    if readings[1.0] <= 0:
        return None
    floor = readings[1.0] - tolerance
    span = []
    for side in (
        sorted((f for f in readings if f < 1.0), reverse=True),
        sorted(f for f in readings if f > 1.0),
    ):
        end = 1.0
        for f in side:
            if readings[f] < floor:
                break
            end = f
        span.append(end)
    return span[0], span[1]


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
    resampled so that its typical symbol is `target.symbol_size` px and redrawn with the training pen, each unless
    the image's measure lies in the target's range for it. Without a target only polarity and contrast change.
    `max_height` > 0 shrinks taller results to fit; `polarity` as to_ink's."""
    ink = to_ink(image, polarity)
    if not ink.any():
        return np.zeros((2 * MARGIN + 1, 2 * MARGIN + 1), np.uint8)
    rows, cols = np.flatnonzero(ink.any(1)), np.flatnonzero(ink.any(0))
    ink = ink[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    if target is not None:
        found = measure(ink)
        factor = core(target) / core(found) if found and core(found) > 0 else 1.0
        if not SCALE_RANGE[0] <= factor <= SCALE_RANGE[1] or _inside(found.symbol_size, target.symbol_range):
            factor = 1.0
        h, w = ink.shape
        if max_height > 0 and h * factor > max_height - 2 * MARGIN:
            factor = (max_height - 2 * MARGIN) / h
        redraw = found is not None and not _inside(found.stroke_width * factor, target.stroke_range)
        pen = pen_width(target)
        if factor != 1.0:
            size = (max(1, round(w * factor)), max(1, round(h * factor)))
            if (
                redraw
            ):  # drawn first with the pen that the resampling brings to the target's: thin strokes survive
                ink = ndi.binary_dilation(skeletonize(ink), structure=_pen(max(1.0, pen / factor)))
            grey = Image.fromarray(ink.astype(np.uint8) * 255).resize(size, Image.Resampling.BILINEAR)
            ink = np.asarray(grey) >= 128
        if redraw and ink.any():  # the skeleton drawn again with the training pen
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
