"""The one module that relies on matplotlib's private `_mathtext` (wapstable/data/render/glyph_hook.py): every
internal it hooks is still there and still behaves as the hook reads it. A matplotlib whose internals changed fails
here, naming what changed, instead of quietly rendering images without symbol boxes."""

import inspect

import numpy as np
from matplotlib import _mathtext
from matplotlib.mathtext import MathTextParser

from wapstable.data.render.glyph_hook import GlyphRecorder, laid_out_source
from wapstable.data.render.mathtext import font_properties, tokens_to_mathtext


def test_the_hooked_internals_are_there_with_the_arguments_the_hooks_pass_on():
    params = {
        "Char.__init__": inspect.signature(_mathtext.Char.__init__).parameters,
        "Char.render": inspect.signature(_mathtext.Char.render).parameters,
        "Rule.__init__": inspect.signature(_mathtext.Rule.__init__).parameters,
        "Rule.render": inspect.signature(_mathtext.Rule.render).parameters,
        "ship": inspect.signature(_mathtext.ship).parameters,
    }
    assert list(params["Char.render"])[:2] == ["self", "output"]
    assert list(params["Rule.render"]) == ["self", "output", "x", "y", "w", "h"]
    assert list(params["ship"])[:1] == ["box"]
    assert callable(MathTextParser._parse_cached.cache_clear)  # a cached parse would record nothing


def test_a_recorded_layout_holds_every_glyph_and_rule_in_creation_order():
    """\\frac{x}{2}: the parser creates x, then 2, then the bar; each glyph's box (from the output's glyph metrics)
    holds its ink, and the bar's box is the rule between them."""
    img, items = laid_out_source(
        tokens_to_mathtext("\\frac { x } { 2 }".split()), font_properties("cm", 20), True
    )
    assert [(kind, c) for _, kind, _, c in sorted(items)] == [("g", "x"), ("g", "2"), ("r", "")]
    h, w = img.shape
    boxes = {c or "bar": box for _, _, box, c in items}
    for name, (x0, y0, x1, y1) in boxes.items():
        assert 0 <= x0 < x1 <= w + 1 and 0 <= y0 < y1 <= h + 1, (name, img.shape)
        assert img[int(y0) : int(np.ceil(y1)), int(x0) : int(np.ceil(x1))].any(), name
    assert boxes["x"][3] <= boxes["bar"][1] + 1 and boxes["bar"][3] <= boxes["2"][1] + 1  # x above, 2 below


def test_the_hooks_are_removed_after_the_parse():
    saved = (_mathtext.Char.__init__, _mathtext.Rule.__init__, _mathtext.Char.render, _mathtext.Rule.render)
    recorder = GlyphRecorder()
    with recorder.on():
        assert _mathtext.Char.render is not saved[2]
    assert (
        _mathtext.Char.__init__,
        _mathtext.Rule.__init__,
        _mathtext.Char.render,
        _mathtext.Rule.render,
    ) == saved
    assert _mathtext.ship is not None
    img, items = laid_out_source("$x$", font_properties("cm", 20), record=False)
    assert img.any() and items == []
