"""One CROHME InkML file as a Sample (data=crohme): its traces rasterised (ink.raster), optionally drawn again in
another hand (ink.redraw), its truth normalised (ink.inkml), and each symbol's box (ink.boxes)."""

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from wapstable.data.ink.boxes import symbol_boxes
from wapstable.data.ink.inkml import local_tag, parse_trace, read_truth, symbol_groups
from wapstable.data.ink.raster import Raster, rasterize_traces
from wapstable.data.ink.redraw import Redraw, redraw_traces
from wapstable.data.latex import DataError
from wapstable.data.sample import Sample


def read_inkml(path: str | Path, raster: Raster, redraw: Redraw | None = None) -> Sample:
    """One InkML file as a Sample: id = file stem, image = all traces rasterised, tokens = normalised truth.

    With `redraw`, the strokes as another hand would write them (redraw_traces), the image's scale varied too (its
    symbol size by 10 % times the strength), and the id "STEM~N" for the N-th drawing.
    Raises DataError naming the file (and with a `reason`) for malformed XML, a missing, broken or out-of-dictionary
    truth, or no drawable ink.
    """
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise DataError(f"{path}: not readable InkML ({e})", "malformed XML") from None
    tokens = read_truth(path, root)
    traces, ids = [], []
    for el in root.iter():
        if local_tag(el.tag) == "trace":
            try:
                traces.append(parse_trace(el.text or ""))
            except ValueError as e:
                raise DataError(
                    f"{path}: trace {el.get('id')!r} is malformed: {e}", "malformed trace"
                ) from None
            ids.append(el.get("id"))
    if not any(len(t) for t in traces):
        raise DataError(f"{path}: no <trace> with points", "no ink")
    stem, symbol_size = path.stem, raster.symbol_size
    if redraw is not None:
        rng = redraw.rng(stem)
        traces = redraw_traces(traces, symbol_groups(root, ids), rng, redraw.strength)
        symbol_size *= float(np.exp(rng.normal(0, 0.1 * redraw.strength)))
        stem = f"{stem}~{redraw.index}"
    by_id = dict(zip(ids, traces))
    transform = []
    try:
        image = rasterize_traces(
            traces, raster.height, raster.line_width, symbol_size=symbol_size, transform=transform
        )
    except ValueError as e:
        raise DataError(f"{path}: cannot rasterise the traces: {e}", "no ink") from None
    if not image.any():
        raise DataError(f"{path}: the traces draw an empty image", "no ink")
    boxes = symbol_boxes(root, tokens, by_id, transform[0], raster.line_width, image.shape)
    return Sample(stem, image, tokens, boxes)
