"""Pen strokes rasterised to WAP-style images: the one rasteriser of CROHME's ink and of rendered handwriting."""

import math
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

# Widest image, in multiples of its height: a long expression of tiny flat marks (dots, minus signs) would
# otherwise be scaled to thousands of pixels wide.
MAX_ASPECT = 32.0


def rasterize_traces(
    traces: list[np.ndarray],
    height: int,
    line_width: int,
    margin: int = 4,
    max_aspect: float = MAX_ASPECT,
    symbol_size: float = 0.0,
    transform: list | None = None,
) -> np.ndarray:
    """Draw pen strokes as an (H, W) uint8 image, ink 255 on 0.

    With `symbol_size` 0 the image is `height` rows: the ink is scaled to fill `height - 2*margin` rows with its
    aspect kept, except that flat ink (a lone minus) is scaled as if as tall as its median stroke is long, centred
    vertically. With `symbol_size` > 0 the scale is kept instead: the median stroke (about one symbol) is drawn
    `symbol_size` px long and the image is as tall as the ink needs, up to `height` rows (taller ink is shrunk to
    fit). No image is wider than `max_aspect * height`. Strokes are polylines `line_width` px wide with round ends;
    lone points are dots. A `transform` list gets (lo (2,), scale, offset (2,)): ink point p is drawn at pixel
    (p - lo) * scale + offset.
    """
    box = height - 2 * margin
    if box < 1:
        raise ValueError(f"height {height} leaves no room inside a margin of {margin}")
    traces = [np.asarray(t, dtype=np.float64)[:, :2] for t in traces if len(t)]
    if not traces:
        raise ValueError("no points to draw")
    pts = np.concatenate(traces)
    if not np.isfinite(pts).all():
        raise ValueError("non-finite coordinates")
    lo = pts.min(0)
    ink_w, ink_h = pts.max(0) - lo
    # Treat the ink as at least as tall as its typical stroke is long, so that flat ink (a lone minus, "= -") is
    # drawn at symbol size instead of stretched out; and never exceed the width cap.
    stroke = float(np.median([np.ptp(t, axis=0).max() for t in traces]))
    max_w = max(max_aspect * height - 2 * margin, 1.0)
    extent = max(max(ink_h, stroke) / box, ink_w / max_w)
    if symbol_size > 0 and stroke > 0:
        extent = max(extent, stroke / symbol_size)  # the symbol's own size, unless the ink then does not fit
    scale = 1.0 / extent if extent > 0 else 1.0
    width = int(math.ceil(ink_w * scale)) + 2 * margin + 1
    if symbol_size > 0:
        height = min(height, int(math.ceil(max(ink_h, stroke) * scale)) + 2 * margin + 1)
        box = height - 2 * margin
    y0 = margin + (box - ink_h * scale) / 2  # centre ink that ends up shorter than the box

    if transform is not None:
        transform.append((lo, scale, np.array([margin, y0])))
    img = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(img)
    r = line_width / 2
    for t in traces:
        xy = [(margin + (x - lo[0]) * scale, y0 + (y - lo[1]) * scale) for x, y in t]
        if len(xy) > 1 and np.ptp(t, axis=0).any():
            draw.line(xy, fill=255, width=line_width, joint="curve")
            ends = (xy[0], xy[-1])  # Pillow's line ends are square cut; round them like a pen tip
        else:
            ends = (xy[0],)
        for x, y in ends:
            if r >= 1:
                draw.ellipse((x - r, y - r, x + r, y + r), fill=255)
            else:
                draw.point((x, y), fill=255)
    return np.asarray(img, dtype=np.uint8)


class Raster(NamedTuple):
    """How strokes become pixels (data.scale, data.height, data.symbol_size, data.line_width)."""

    height: int = 64  # scale=height: every image this tall; scale=symbol: the tallest image
    line_width: int = 2
    symbol_size: float = 0.0  # > 0: keep the scale, a typical symbol this many px (scale=symbol)

    @classmethod
    def of(cls, cfg_data) -> "Raster":
        symbol = float(cfg_data.symbol_size) if str(cfg_data.scale) == "symbol" else 0.0
        return cls(int(cfg_data.height), int(cfg_data.line_width), symbol)
