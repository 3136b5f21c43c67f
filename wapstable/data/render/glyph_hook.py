"""Where mathtext puts each glyph and rule of an expression: hooks on matplotlib's private `_mathtext` module.

This is the one place that relies on matplotlib's internals: `_mathtext.Char` and `_mathtext.Rule` (their
__init__ and render, a Char's `c`), `_mathtext.ship`, the `glyphs` list of the output a Char renders into (each
entry `(ox, oy, info)` with `info.metrics` xmin, xmax, ymin, ymax) and `MathTextParser._parse_cached`.
`tests/test_glyph_hook.py` fails when any of them changes; the renderers then draw their images without boxes
(an AttributeError here is caught by mathtext.render).
"""

import itertools
from contextlib import contextmanager
from functools import cache

import numpy as np
from matplotlib import _mathtext
from matplotlib.mathtext import MathTextParser


class GlyphRecorder:
    """Hooks on mathtext's layout while one expression is parsed. Every Char and Rule gets a creation number: the
    parser creates a symbol's Char as it reads the symbol, and a fraction's bar or a root's sign when it has read
    their arguments, so creation order follows the tokens (see token_boxes). Every ship() records where it
    put each Char and Rule; the last ship of a parse is the one that draws the image (to_raster's, already moved
    into the image's coordinates). The hooks are removed when the parse ends."""

    def __init__(self):
        self.count = itertools.count()
        self.items: list[tuple[int, str, tuple, str]] = []  # (creation number, "g" or "r", box, symbol)

    @contextmanager
    def on(self):
        rec, M = self, _mathtext
        saved = (M.Char.__init__, M.Rule.__init__, M.Char.render, M.Rule.render, M.ship)
        char_init, rule_init, char_render, rule_render, ship = saved

        def new_char_init(node, *args, **kwargs):
            char_init(node, *args, **kwargs)
            node._wap_seq = next(rec.count)

        def new_rule_init(node, *args, **kwargs):
            rule_init(node, *args, **kwargs)
            node._wap_seq = next(rec.count)

        def new_char_render(node, output, *args, **kwargs):
            n = len(output.glyphs)
            char_render(node, output, *args, **kwargs)
            for ox, oy, info in output.glyphs[n:]:
                m = info.metrics
                box = (ox + m.xmin, oy - m.ymax, ox + m.xmax, oy - m.ymin)
                rec.items.append((getattr(node, "_wap_seq", -1), "g", box, node.c))

        def new_rule_render(node, output, x, y, w, h):
            rule_render(node, output, x, y, w, h)
            rec.items.append((getattr(node, "_wap_seq", -1), "r", (x, y - h, x + w, y), ""))

        def new_ship(*args, **kwargs):
            rec.items = []
            return ship(*args, **kwargs)

        M.Char.__init__, M.Rule.__init__ = new_char_init, new_rule_init
        M.Char.render, M.Rule.render, M.ship = new_char_render, new_rule_render, new_ship
        try:
            yield self
        finally:
            M.Char.__init__, M.Rule.__init__, M.Char.render, M.Rule.render, M.ship = saved


@cache
def _parser() -> MathTextParser:
    return MathTextParser("agg")


def laid_out_source(source: str, prop, record: bool) -> tuple[np.ndarray, list]:
    """Mathtext's (H, W) uint8 image of `source` ("$...$") in font `prop` and, with `record`, the glyphs and rules of
    its layout (GlyphRecorder.items; an empty list without)."""
    if not record:
        return np.asarray(_parser().parse(source, dpi=72, prop=prop).image, dtype=np.uint8), []
    MathTextParser._parse_cached.cache_clear()  # a cached parse lays nothing out, so it records nothing
    recorder = GlyphRecorder()
    with recorder.on():
        img = np.asarray(_parser().parse(source, dpi=72, prop=prop).image, dtype=np.uint8)
    return img, recorder.items
