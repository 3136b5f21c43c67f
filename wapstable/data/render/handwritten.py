"""data.style=handwritten: mathtext's layout of an expression with every glyph drawn as pen strokes instead of
filled outlines (glyphs), moved where writers put scripts and spaced as they space symbols (placement), and
rasterised by the very code that draws real CROHME ink (ink.raster), so the images follow data=crohme's conventions.
"""

import numpy as np

from wapstable.data.ink.raster import rasterize_traces
from wapstable.data.render import glyphs, placement
from wapstable.data.render.mathtext import laid_out
from wapstable.data.render.token_boxes import grow_box, match_layout
from wapstable.data.sample import no_boxes


def is_radical(c: str) -> bool:
    """Whether a glyph is a root's sign: "\\__radicalbig__" and its sizes in cm, the character √ in the other sets."""
    return c == "\N{SQUARE ROOT}" or c.startswith("\\__radical")


def render_handwritten(
    tokens: list[str],
    font: str,
    font_size: int,
    rng: np.random.Generator,
    raster,
    jitter: float = 1.0,
    bank=None,
    distort: float = 0.0,
    allographs: float = 0.0,
    script_place: float = 0.0,
    font_mix: float = 0.0,
    spacing: float = 0.0,
    size_jitter: float = 0.0,
    more_forms: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """data.style=handwritten: the image of `tokens` drawn as pen strokes on mathtext's layout (font set `font`
    at `font_size`), rasterised like InkML by `raster` (wapstable.data.ink.raster.Raster), and its tokens' boxes
    (NaN rows for inkless tokens, all NaN when the layout could not be matched to the tokens). With `bank`
    (wapstable.data.ink.bank: data.glyphs=crohme), each symbol the bank has is a real written sample of it.
    `jitter` scales every glyph's random scale, rotation, shift and wobble and the expression's slant (data.jitter;
    0 draws the layout exactly); `distort` > 0 also changes each glyph's shape (data.distort, glyphs.distort_glyph);
    `allographs` is the chance that a symbol with other hand-written forms is drawn in one (data.allographs);
    `script_place` the chance that a script is moved to where writers put it (data.script_place, placement.place_scripts);
    `font_mix` the chance that a glyph is drawn in a stroke font drawn for it alone (data.font_mix); `spacing` how
    far apart the symbols are set beyond mathtext's spacing, as writers set them (data.spacing, placement.spread_symbols);
    `size_jitter` the spread of the expression's size: its typical symbol drawn raster.symbol_size times
    exp(N(0, size_jitter)) px (data.size_jitter); `more_forms` the chance that a symbol of glyphs.MORE_FORMS, or a
    root's sign, is drawn in one of its other forms (data.more_forms)."""
    _, recorded = laid_out(tokens, font, font_size, record=True)
    items = sorted(recorded, key=lambda item: item[0])
    matched = match_layout(tokens, recorded)
    owners = [m[0] for m in matched] if matched is not None else [None] * len(items)
    text_font = glyphs.text_font(rng)
    drawn: list[tuple[int | None, np.ndarray]] = []  # (token index, stroke)
    k = 0
    while k < len(items):
        _, kind, box, c = items[k]
        if kind == "g" and is_radical(c):
            bar = items[k + 1][2] if k + 1 < len(items) and items[k + 1][1] == "r" else None
            end, top = (bar[2], (bar[1] + bar[3]) / 2) if bar is not None else (box[2], box[1])
            strokes = glyphs.draw_radical(box, end, top, rng, jitter, font_size, bank, more_forms)
            k += bar is not None  # the bar is drawn with its sign
        elif kind == "r":
            strokes = glyphs.draw_rule(box, rng, jitter, font_size, bank)
        else:
            glyph_font = text_font
            if font_mix > 0 and rng.random() < font_mix:  # no draw at 0: the images stay bit for bit
                glyph_font = glyphs.text_font(rng)
            strokes = glyphs.draw_glyph(
                c, box, font_size, glyph_font, rng, jitter, bank, distort, allographs, more_forms
            )
        drawn += [(owners[k], s) for s in strokes]
        k += 1
    if not drawn:
        raise ValueError(f"nothing to draw for {' '.join(tokens)!r}")
    if script_place > 0 and matched is not None:
        drawn = placement.place_scripts(tokens, drawn, rng, script_place, jitter)
    if spacing > 0 and matched is not None:
        drawn = placement.spread_symbols(tokens, drawn, rng, spacing, jitter)
    traces = [s for _, s in drawn]
    if jitter > 0:  # a slant shared by the whole expression, as a writer's
        y_mid = float(np.median(np.concatenate(traces)[:, 1]))
        traces = glyphs.slant(traces, float(rng.normal(0.05, 0.1) * jitter), y_mid)
    symbol_size = raster.symbol_size
    if size_jitter > 0 and symbol_size > 0:  # no draw at 0: the images stay bit for bit
        symbol_size *= float(np.exp(rng.normal(0, size_jitter)))
    transform: list = []
    img = rasterize_traces(
        traces, raster.height, raster.line_width, symbol_size=symbol_size, transform=transform
    )
    lo, scale, offset = transform[0]
    boxes = no_boxes(len(tokens))
    if matched is not None:
        pad = raster.line_width / 2 + 0.5
        h, w = img.shape
        for (owner, _), stroke in zip(drawn, traces):
            px = (stroke - lo) * scale + offset
            x0, y0 = px.min(0) - pad
            x1, y1 = px.max(0) + pad
            grow_box(boxes, owner, (max(0.0, x0), max(0.0, y0), min(float(w), x1), min(float(h), y1)))
    return img, boxes
