"""CROHME InkML (online pen strokes with a LaTeX truth) rasterised to WAP-style images (data=crohme)."""

import logging
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from wapstable.data.latex import DataError, check_on_error, normalize_crohme, on_data_error, tokenize_latex
from wapstable.data.sample import Sample

log = logging.getLogger(__name__)

# Widest image, in multiples of its height: a long expression of tiny flat marks (dots, minus signs) would
# otherwise be scaled to thousands of pixels wide.
MAX_ASPECT = 32.0


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # drop "{http://www.w3.org/2003/InkML}"; some files have no namespace


def parse_trace(text: str) -> np.ndarray:
    """Points of one `<trace>` body ("x y, x y" or "x y t, ...") as an (N, 2) float array of x, y."""
    points = []
    for chunk in text.split(","):
        values = chunk.split()
        if not values:
            continue  # a trailing comma
        if len(values) < 2:
            raise ValueError(f"a point needs x and y, got {chunk.strip()!r}")
        points.append((float(values[0]), float(values[1])))
    return np.asarray(points, dtype=np.float64).reshape(-1, 2)


def rasterize_traces(
    traces: list[np.ndarray], height: int, line_width: int, margin: int = 4, max_aspect: float = MAX_ASPECT
) -> np.ndarray:
    """Draw pen strokes as an (height, W) uint8 image, ink 255 on 0.

    The ink is scaled to fill `height - 2*margin` rows with its aspect kept, except that flat ink (a lone minus)
    is scaled as if as tall as its median stroke is long, centred vertically, and no image is wider than
    `max_aspect * height`. Strokes are polylines `line_width` px wide with round ends; lone points are dots.
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
    # Fit the height, but treat the ink as at least as tall as its typical stroke is long, so that flat ink
    # (a lone minus, "= -") is drawn at symbol size instead of stretched out; and never exceed the width cap.
    stroke = float(np.median([np.ptp(t, axis=0).max() for t in traces]))
    max_w = max(max_aspect * height - 2 * margin, 1.0)
    extent = max(max(ink_h, stroke) / box, ink_w / max_w)
    scale = 1.0 / extent if extent > 0 else 1.0
    width = int(math.ceil(ink_w * scale)) + 2 * margin + 1
    y0 = margin + (box - ink_h * scale) / 2  # centre ink that ends up shorter than the box

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


def read_inkml(path: str | Path, height: int, line_width: int) -> Sample:
    """One InkML file as a Sample: id = file stem, image = all traces rasterised, tokens = normalised truth.

    Raises DataError naming the file for malformed XML, a missing or empty truth, or no drawable ink.
    """
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise DataError(f"{path}: not readable InkML ({e})") from None
    # Only the expression's own truth: traceGroups carry per-symbol truth annotations too.
    truth = next(
        (a.text for a in root if _local(a.tag) == "annotation" and a.get("type") == "truth"),
        None,
    )
    if truth is None or not truth.strip().strip("$").strip():
        raise DataError(f'{path}: no <annotation type="truth"> with the expression\'s LaTeX')
    try:
        tokens = normalize_crohme(tokenize_latex(truth))
    except DataError as e:
        raise DataError(f"{path}: truth '{truth.strip()}' does not parse: {e}") from None
    if not tokens:
        raise DataError(f"{path}: truth '{truth.strip()}' has no tokens after normalisation")

    traces = []
    for el in root.iter():
        if _local(el.tag) == "trace":
            try:
                traces.append(parse_trace(el.text or ""))
            except ValueError as e:
                raise DataError(f"{path}: trace {el.get('id')!r} is malformed: {e}") from None
    if not any(len(t) for t in traces):
        raise DataError(f"{path}: no <trace> with points")
    try:
        image = rasterize_traces(traces, height, line_width)
    except ValueError as e:
        raise DataError(f"{path}: cannot rasterise the traces: {e}") from None
    if not image.any():
        raise DataError(f"{path}: the traces draw an empty image")
    return Sample(path.stem, image, tokens)


def load_crohme_split(
    folder: str | Path, height: int, line_width: int, on_error: str
) -> tuple[list[Sample], list[str]]:
    """Every `*.inkml` under `folder` (recursively, sorted) as Samples, and the messages of skipped files.

    on_error="fail" raises DataError at the first bad file; "skip" logs a warning per file and drops it.
    A missing folder, or one without InkML files, always raises.
    """
    check_on_error(on_error)
    folder = Path(folder)
    hint = "set data.root to the CROHME folder, and data.train/valid/test to its split folders"
    if not folder.is_dir():
        raise DataError(f"the CROHME split folder {folder} does not exist; {hint}")
    files = sorted(folder.rglob("*.inkml"))
    if not files:
        raise DataError(f"the CROHME split folder {folder} has no .inkml files; {hint}")
    samples, errors, seen = [], [], {}
    for f in files:
        try:
            s = read_inkml(f, height, line_width)
        except DataError as e:
            on_data_error(str(e), on_error, errors, log)
            continue
        if s.id in seen:  # ids key predictions and checkpoints, so they must be unique
            on_data_error(f"{f}: id {s.id!r} already used by {seen[s.id]}", on_error, errors, log)
            continue
        seen[s.id] = f
        samples.append(s)
    return samples, errors
