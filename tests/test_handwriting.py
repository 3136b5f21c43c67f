"""data.symbols=crohme (the grammar over the whole CROHME 2014 dictionary) and data.style=handwritten (the layout
drawn as pen strokes), through the renderer, the cache and a real run of train.py."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import compose_config, refusal_in_process, run_train

from wapstable.data.ink.boxes import inked_tokens
from wapstable.data.ink.raster import Raster
from wapstable.data.latex import CROHME_2014_SYMBOLS, DataError
from wapstable.data.render import glyphs, grammar, handwritten, mathtext, placement
from wapstable.data.sample import held_out
from wapstable.data.sources import synthetic
from wapstable.errors import UserError

RASTER = Raster(height=160, line_width=2, symbol_size=24.0)


@pytest.fixture(scope="module")
def crohme_labels():
    return grammar.generate_expressions(2500, seed=0, difficulty=2, symbols="crohme")


def test_crohme_grammar_emits_exactly_the_dictionary(crohme_labels):
    counts = Counter(t for tokens in crohme_labels for t in tokens)
    assert set(counts) == set(CROHME_2014_SYMBOLS), (
        f"missing {sorted(set(CROHME_2014_SYMBOLS) - set(counts))}, "
        f"not in the dictionary {sorted(set(counts) - set(CROHME_2014_SYMBOLS))}"
    )
    # the mix of lengths is that of real labels (CROHME 2014 training: median 13, 90th percentile 32)
    lengths = [len(t) for t in crohme_labels]
    assert 8 <= np.median(lengths) <= 16 and 18 <= np.percentile(lengths, 90) <= 40


def test_base_grammar_is_unchanged_by_the_option():
    """The default data keeps its 85 symbols: none of the dictionary's additions, and the same labels however
    often the CROHME grammar is used beside it."""
    before = grammar.generate_expressions(500, seed=3, difficulty=2)
    grammar.generate_expressions(500, seed=3, difficulty=2, symbols="crohme")
    base = grammar.generate_expressions(500, seed=3, difficulty=2)
    assert base == before
    tokens = {t for tokens in base for t in tokens}
    assert not tokens & {"\\sin", "\\lim", "\\ldots", ",", "\\prime", "\\rightarrow", "\\exists", "|", "!"}
    # and the default config's cache key does not depend on the new keys
    cfg = compose_config([]).data
    assert "symbols" not in synthetic.cache_params(cfg) and "style" not in synthetic.cache_params(cfg)
    cfg.symbols, cfg.style = "crohme", "handwritten"
    params = synthetic.cache_params(cfg)
    assert params["symbols"] == "crohme" and params["style"] == "handwritten" and "hershey" in params


def test_crohme_frequencies_weigh_symbols_as_the_training_labels_do():
    """data.frequencies=crohme: every dictionary symbol still drawn, but 1 and 2 far more often than 7 and 8, x
    than w, and scripts inside fractions (the "x ^ { 2 } }" of real labels); the grammar's own labels unchanged."""
    before = grammar.generate_expressions(800, seed=5, difficulty=2, symbols="crohme")
    weighted = grammar.generate_expressions(
        2500, seed=0, difficulty=2, symbols="crohme", frequencies="crohme"
    )
    assert grammar.generate_expressions(800, seed=5, difficulty=2, symbols="crohme") == before
    counts = Counter(t for tokens in weighted for t in tokens)
    assert set(counts) == set(CROHME_2014_SYMBOLS), sorted(set(CROHME_2014_SYMBOLS) - set(counts))
    old = Counter(t for tokens in before for t in tokens)
    share = {k: c / sum(counts.values()) for k, c in counts.items()}
    old_share = {k: c / sum(old.values()) for k, c in old.items()}
    assert share["2"] > 3 * share["7"] and share["1"] > 3 * share["8"] and share["x"] > 5 * share["w"]
    assert old_share["2"] < 2 * old_share["7"]  # what the grammar alone draws: digits about alike
    assert share["\\prime"] < old_share["\\prime"] / 1.5 and share["\\frac"] > old_share["\\frac"]

    def nested(labels):  # scripts closing inside another group
        return sum(" } }" in " ".join(t) for t in labels) / len(labels)

    assert nested(weighted) > 3 * nested(before)
    lengths = [len(t) for t in weighted]
    assert 8 <= np.median(lengths) <= 16 and 18 <= np.percentile(lengths, 90) <= 40
    # a key of the cache only when set, and only with the CROHME symbols
    cfg = compose_config(["data.symbols=crohme"]).data
    assert "frequencies" not in synthetic.cache_params(cfg)
    cfg.frequencies = "crohme"
    assert synthetic.cache_params(cfg)["frequencies"] == "crohme"
    cfg.symbols = "base"
    with pytest.raises(UserError, match="set data.symbols=crohme"):
        synthetic.cache_params(cfg)


def first_with(labels, symbol):
    return next(tokens for tokens in labels if symbol in tokens)


@pytest.mark.parametrize("style", ["printed", "handwritten"])
def test_every_dictionary_symbol_is_drawn_where_its_box_says(crohme_labels, style):
    """For each of the 110 symbols, an expression holding it renders with its layout matched to its tokens, and
    every token that draws has a box with ink in it (both styles)."""
    for symbol in CROHME_2014_SYMBOLS:
        tokens = first_with(crohme_labels, symbol)
        rng = np.random.default_rng(0)
        if style == "printed":
            img, boxes = mathtext.render_boxes(tokens, "cm", 28, rng, augment=False)
        else:
            img, boxes = handwritten.render_handwritten(tokens, "cm", 28, rng, RASTER)
        assert img.dtype == np.uint8 and img.max() == 255 and img[0].max() == 0, symbol
        assert boxes.shape == (len(tokens), 4)
        assert not np.isnan(boxes).all(), f"{symbol}: the layout of {' '.join(tokens)} was not matched"
        for i in inked_tokens(tokens):  # every token but braces, ^ _ \\limits and a root index's [ ]
            tok = tokens[i]
            x0, y0, x1, y1 = boxes[i]
            assert not np.isnan(x0), f"{tok} in {' '.join(tokens)} has no box"
            patch = img[int(y0) : int(np.ceil(y1)), int(x0) : int(np.ceil(x1))]
            assert patch.size and patch.max() > 0, f"{tok} in {' '.join(tokens)}: no ink in its box"


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_every_glyph_the_layout_uses_has_strokes(crohme_labels):
    """No glyph of the dictionary falls back to the placeholder stroke, in any text font: each has its own
    strokes from the Hershey fonts or from DRAWN."""
    seen = set()
    for tokens in crohme_labels[:150]:
        for font in mathtext.FONTS:
            _, items = mathtext.laid_out(tokens, font, 28, record=True)
            seen |= {c for _, kind, _, c in items if kind == "g"}
    missing = {
        (c, f)
        for c in seen
        for f in glyphs.TEXT_FONTS
        if not handwritten.is_radical(c) and glyphs.unit_strokes(c, f) is None
    }
    assert not missing
    # and the placeholder is what an unknown glyph gets, so the check above has something to catch
    assert glyphs.unit_strokes("\\nosuchsymbol", "futural") is None


def test_handwritten_image_conventions_and_determinism():
    tokens = "\\frac { \\sin ( x ) } { 2 } + \\sqrt { y }".split()
    a, boxes_a = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(5), RASTER)
    b, boxes_b = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(5), RASTER)
    c, _ = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(6), RASTER)
    assert np.array_equal(a, b) and np.array_equal(boxes_a, boxes_b, equal_nan=True)
    assert a.shape != c.shape or not np.array_equal(a, c)  # another seed, another hand
    assert a.shape[0] <= RASTER.height
    # as data=crohme draws ink: strokes line_width px wide, ink 255 on 0, nothing in between but antialiasing-free
    assert set(np.unique(a)) <= {0, 255}
    # without jitter, the strokes stay inside the layout's boxes: the \frac bar spans the wider of its arguments
    flat, boxes = handwritten.render_handwritten(
        tokens, "cm", 28, np.random.default_rng(5), RASTER, jitter=0.0
    )
    bar, sin = boxes[0], boxes[tokens.index("\\sin")]
    assert bar[2] - bar[0] >= sin[2] - sin[0] and bar[1] > sin[3] - 2


def _affine_residual(a: np.ndarray, b: np.ndarray) -> float:
    """The largest distance left between points `b` and the best affine image of points `a` (least squares)."""
    design = np.hstack([a, np.ones((len(a), 1))])
    coef, *_ = np.linalg.lstsq(design, b, rcond=None)
    return float(np.abs(design @ coef - b).max())


@pytest.mark.parametrize("glyph", ["x", "4", "\\sum", "\\alpha"])
def test_distort_changes_a_glyph_s_shape_not_only_its_place(glyph):
    """data.distort: with the same random stream, 0 draws exactly today's glyph, > 0 a glyph no affine map of it
    reaches (strokes moved apart, the whole bent), within a bound that grows with the amount."""
    box, size = (10.0, 20.0, 30.0, 48.0), 28.0

    def draw(distort, seed=3):
        rng = np.random.default_rng(seed)
        return glyphs.draw_glyph(glyph, box, size, "futural", rng, 1.0, None, distort)

    plain = draw(0.0)
    legacy = glyphs.draw_glyph(glyph, box, size, "futural", np.random.default_rng(3), 1.0)
    assert all(np.array_equal(a, b) for a, b in zip(plain, legacy)) and len(plain) == len(legacy)
    one, again, two = draw(1.0), draw(1.0), draw(2.0)
    assert all(np.array_equal(a, b) for a, b in zip(one, again))  # the same stream, the same hand
    a, b1, b2 = np.concatenate(plain), np.concatenate(one), np.concatenate(two)
    assert a.shape == b1.shape == b2.shape  # points are moved, not added or lost
    assert _affine_residual(a, b1) > 0.01 * size  # a new shape, not a moved, turned or scaled copy
    move1, move2 = np.abs(b1 - a).max(), np.abs(b2 - a).max()
    assert move1 < 0.6 * size and move2 < 1.2 * size  # still the same symbol, near its box
    # the bend grows with the amount: over seeds, twice the amount moves the points further on average
    mean = {
        d: np.mean(
            [np.abs(np.concatenate(draw(d, k)) - np.concatenate(draw(0.0, k))).mean() for k in range(20)]
        )
        for d in (0.5, 1.0, 2.0)
    }
    assert mean[0.5] < mean[1.0] < mean[2.0]
    # without the jitter (data.jitter=0) the shape still changes: the two keys are independent
    exact = glyphs.draw_glyph(glyph, box, size, "futural", np.random.default_rng(3), 0.0)
    bent = glyphs.draw_glyph(glyph, box, size, "futural", np.random.default_rng(3), 0.0, None, 1.0)
    assert _affine_residual(np.concatenate(exact), np.concatenate(bent)) > 0.01 * size


def _same_strokes(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.allclose(x, y, atol=1e-9) for x, y in zip(a, b))


def test_allographs_draw_the_other_forms_by_their_chance():
    """data.allographs: 0 draws exactly the fonts' glyphs without touching the random stream; 1 draws every symbol
    that has other forms in one of them, each form in turn; between, both; a symbol without other forms and the
    real ink of data.glyphs=crohme are never changed."""
    box, size = (10.0, 20.0, 30.0, 48.0), 28.0

    def draw(c, chance, seed, jitter=0.0):
        return glyphs.draw_glyph(
            c, box, size, "futural", np.random.default_rng(seed), jitter, None, 0.0, chance
        )

    forms = {c: [glyphs.to_unit(f) for f in fs] for c, fs in glyphs.ALLOGRAPHS.items()}
    for c in ("1", "x", "\\alpha", "w"):
        legacy = glyphs.draw_glyph(c, box, size, "futural", np.random.default_rng(3), 1.0)
        assert _same_strokes(draw(c, 0.0, 3, jitter=1.0), legacy)  # the stream untouched at 0
    font = glyphs.to_unit(draw("4", 0.0, 0))
    seen = {c: set() for c in forms}
    for seed in range(40):
        for c, options in forms.items():
            unit = glyphs.to_unit(draw(c, 1.0, seed))
            match = [k for k, f in enumerate(options) if _same_strokes(unit, f)]
            assert match, f"{c} at chance 1 was not drawn in one of its forms"
            seen[c].add(match[0])
    assert all(seen[c] == set(range(len(forms[c]))) for c in forms)  # every form is drawn
    assert not any(_same_strokes(font, f) for f in forms["4"])  # the forms are not the font's glyph
    half = [any(_same_strokes(glyphs.to_unit(draw("4", 0.5, k)), f) for f in forms["4"]) for k in range(200)]
    assert 60 < sum(half) < 140  # about half of them
    # a symbol without other forms is drawn as before
    assert all(_same_strokes(draw("w", 1.0, k, 1.0), draw("w", 0.0, k, 1.0)) for k in range(5))
    # real ink (data.glyphs=crohme) is drawn as written, whatever the chance
    bank = {"4": [[np.array([(0.0, 0.0), (1.0, 2.0)]), np.array([(1.0, 0.0), (0.0, 2.0)])]]}
    real = glyphs.draw_glyph("4", box, size, "futural", np.random.default_rng(1), 0.0, bank, 0.0, 1.0)
    assert _same_strokes(glyphs.to_unit(real), glyphs.to_unit(bank["4"][0]))


def _build_handwritten(tmp_path, *extra):
    """The cache parameters and splits of a tiny handwritten config with `extra` overrides, cached under tmp_path."""
    base = ["debug=tiny", "data.style=handwritten", "data.symbols=crohme", "data.render_workers=1"]
    cfg = compose_config([*base, *extra]).data
    cfg.cache_dir = str(tmp_path)
    return synthetic.cache_params(cfg), synthetic.build_splits(cfg)


def _own_cache_entry(tmp_path, key: str, *extra) -> tuple[dict, dict]:
    """The splits at data.KEY's default and at data.KEY=1 (both with the overrides `extra`): the default keeps the
    cache key of the configs before the key existed, 1 is cached under its own entry, and both hold the same labels."""
    params, plain = _build_handwritten(tmp_path, *extra)
    assert key not in params
    p, other = _build_handwritten(tmp_path, *extra, f"data.{key}=1")
    assert p[key] == 1.0 and len(list(tmp_path.rglob("splits.npz"))) == 2
    assert [s.tokens for s in other["train"]] == [s.tokens for s in plain["train"]]
    return plain, other


def _changes_exactly_where(tmp_path, key: str, touches) -> None:
    """data.KEY=1 draws another image exactly for the training labels `touches` says it reaches, under its own cache
    entry; its default keeps the cache key of the configs before it."""
    plain, other = _own_cache_entry(tmp_path, key)
    count = 0
    for x, y in zip(other["train"], plain["train"]):
        changed = x.image.shape != y.image.shape or not np.array_equal(x.image, y.image)
        assert changed == touches(x.tokens), x.tokens
        count += changed
    assert 0 < count < len(plain["train"])  # both kinds occur, so the test tells them apart


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_allographs_is_a_key_of_the_cache_and_of_the_pixels(tmp_path):
    """data.allographs draws another image exactly where a label holds a symbol with other forms."""
    names = ("\\sin", "\\cos", "\\tan", "\\log", "\\lim")  # drawn as their letters

    def has_other_forms(tokens):
        drawn = set(tokens) | {ch for t in tokens if t in names for ch in t[1:]}
        return bool(drawn & set(glyphs.ALLOGRAPHS))

    _changes_exactly_where(tmp_path, "allographs", has_other_forms)


def test_more_forms_draw_their_symbols_and_roots_by_their_chance():
    """data.more_forms: 0 draws the fonts' glyphs and RADICAL without touching the random stream; 1 draws every
    symbol of MORE_FORMS in one of its forms, each in turn, and every root's sign as one of RADICALS; the symbols of
    ALLOGRAPHS keep to data.allographs."""
    box, size = (10.0, 20.0, 30.0, 48.0), 28.0

    def draw(c, more, seed, jitter=0.0, allographs=0.0):
        rng = np.random.default_rng(seed)
        return glyphs.draw_glyph(c, box, size, "futural", rng, jitter, None, 0.0, allographs, more)

    forms = {c: [glyphs.to_unit(f) for f in fs] for c, fs in glyphs.MORE_FORMS.items()}
    for c in ("0", "(", "\\beta", "4"):
        legacy = glyphs.draw_glyph(c, box, size, "futural", np.random.default_rng(3), 1.0, None, 0.0, 0.5)
        assert _same_strokes(draw(c, 0.0, 3, jitter=1.0, allographs=0.5), legacy)
    seen = {c: set() for c in forms}
    for seed in range(30):
        for c, options in forms.items():
            unit = glyphs.to_unit(draw(c, 1.0, seed))
            match = [k for k, f in enumerate(options) if _same_strokes(unit, f)]
            assert match, f"{c} at chance 1 was not drawn in one of its forms"
            seen[c].add(match[0])
        # data.allographs alone decides the symbols of ALLOGRAPHS
        assert _same_strokes(draw("4", 1.0, seed, 1.0), draw("4", 0.0, seed, 1.0))
    assert all(seen[c] == set(range(len(forms[c]))) for c in forms)
    assert not any(_same_strokes(glyphs.to_unit(draw("0", 0.0, 0)), f) for f in forms["0"])

    def sign(more, seed, jitter=0.0):  # the sign's points before the bar, in the unit of its box
        (pts,) = glyphs.draw_radical(
            (0.0, 0.0, 10.0, 20.0), 60.0, 0.0, np.random.default_rng(seed), jitter, 28.0, None, more
        )
        return pts

    (legacy,) = glyphs.draw_radical((0.0, 0.0, 10.0, 20.0), 60.0, 0.0, np.random.default_rng(1), 1.0, 28.0)
    assert np.array_equal(sign(0.0, 1, 1.0), legacy)
    assert np.allclose(sign(0.0, 0)[:-1] / (10.0, 20.0), glyphs.RADICAL)
    seen = set()
    for k in range(30):
        pts = sign(1.0, k)
        assert (pts[-1] == (60.0, 0.0)).all() and pts[-2, 1] == 0.0  # the bar from the sign's top to its end
        unit = pts[:-1] / (10.0, 20.0)
        match = [i for i, r in enumerate(glyphs.RADICALS) if len(r) == len(unit) and np.allclose(unit, r)]
        assert match, "a root's sign at chance 1 is not one of RADICALS"
        seen.add(match[0])
    assert seen == set(range(len(glyphs.RADICALS)))


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_more_forms_is_a_key_of_the_cache_and_of_the_pixels(tmp_path):
    """data.more_forms draws another image exactly where a label holds a symbol of MORE_FORMS or a root."""
    names = ("\\sin", "\\cos", "\\tan", "\\log", "\\lim")  # drawn as their letters

    def has_more_forms(tokens):
        drawn = set(tokens) | {ch for t in tokens if t in names for ch in t[1:]}
        return bool(drawn & set(glyphs.MORE_FORMS)) or "\\sqrt" in tokens

    _changes_exactly_where(tmp_path, "more_forms", has_more_forms)


@pytest.mark.slow  # make test-all
def test_jitter_and_distort_are_keys_of_the_cache_and_of_the_pixels(tmp_path):
    """data.jitter and data.distort each draw other images under their own cache entry; their defaults leave the
    cache key of a config as it was before they existed."""
    params, plain = _build_handwritten(tmp_path)
    assert "jitter" not in params and "distort" not in params  # the caches of existing configs stay valid
    for extra, key, value in (("data.jitter=2", "jitter", 2.0), ("data.distort=1", "distort", 1.0)):
        p, other = _build_handwritten(tmp_path, extra)
        assert p[key] == value
        # the same expressions
        assert [s.tokens for s in other["train"]] == [s.tokens for s in plain["train"]]
        changed = sum(
            x.image.shape != y.image.shape or not np.array_equal(x.image, y.image)
            for x, y in zip(other["train"], plain["train"])
        )
        assert changed == len(plain["train"])  # every image drawn in another hand
    assert len(list(tmp_path.rglob("splits.npz"))) == 3
    # data.jitter=0 draws no jitter even with data.augment on: the same pixels as data.augment=false
    _, still = _build_handwritten(tmp_path, "data.jitter=0")
    _, off = _build_handwritten(tmp_path, "data.augment=false")
    assert all(np.array_equal(x.image, y.image) for x, y in zip(still["train"], off["train"]))


def _placement(boxes, base, script):
    """A script's height as a share of its base's, the shift of its centre below the base's and its gap after the
    base, both in base heights (as docs/studies/handwriting.md measures real ink)."""
    b, s = boxes[base], boxes[script]
    h = b[3] - b[1]
    return (s[3] - s[1]) / h, (s[1] + s[3] - b[1] - b[3]) / 2 / h, (s[0] - b[2]) / h


def test_script_place_puts_scripts_where_writers_do():
    """data.script_place=1: a subscript smaller, lower and further right, a superscript higher, what follows a
    script moved with it; limits under a sum stay; 0 is mathtext's layout, the default's pixels."""
    tokens = "x _ { 2 } + y ^ { 3 } - \\sum _ { i } b".split()
    x, two, plus, y, three, total, i = 0, 3, 5, 6, 9, 12, 15

    def draw(chance):
        return handwritten.render_handwritten(
            tokens, "cm", 28, np.random.default_rng(1), RASTER, 0.0, script_place=chance
        )

    (img0, layout), (_, placed) = draw(0.0), draw(1.0)
    default, _ = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(1), RASTER, 0.0)
    assert np.array_equal(img0, default)
    size0, down0, gap0 = _placement(layout, x, two)
    size1, down1, gap1 = _placement(placed, x, two)
    assert size1 < 0.85 * size0 and down1 > down0 + 0.08 and gap1 > gap0 + 0.1
    size_up0, up0, _ = _placement(layout, y, three)
    size_up1, up1, _ = _placement(placed, y, three)
    assert up1 < up0 - 0.08 and size_up1 == pytest.approx(size_up0, rel=0.1)
    assert placed[plus, 0] > placed[two, 2]  # the + after the subscript is still after it
    # the limit under the sum keeps its place against the sum
    assert np.allclose(layout[i] - layout[total], placed[i] - placed[total], atol=1.0)


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_script_place_is_a_key_of_the_cache_and_of_the_pixels(tmp_path):
    """data.script_place draws another image exactly where a label has a script on a drawn base."""
    _changes_exactly_where(tmp_path, "script_place", lambda tokens: bool(placement.script_groups(tokens)))


def test_script_place_refuses_a_negative_chance():
    cfg = compose_config(["data.style=handwritten", "data.script_place=-0.5"]).data
    with pytest.raises(UserError, match=r"data.script_place=-0.5 must be >= 0"):
        synthetic.cache_params(cfg)


def test_font_mix_draws_glyphs_of_one_expression_in_several_fonts(monkeypatch):
    """data.font_mix: 0 draws every glyph of an expression in its one font, the default's pixels bit for bit; 1
    draws each glyph in a font of its own, so that expressions mix fonts; between, some glyphs only."""
    tokens = "a b + c d = e f g h k m".split()
    default, _ = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(5), RASTER)
    still, _ = handwritten.render_handwritten(
        tokens, "cm", 28, np.random.default_rng(5), RASTER, font_mix=0.0
    )
    assert np.array_equal(default, still)
    fonts: list[str] = []
    drawn = glyphs.draw_glyph

    def record(c, box, size, text_font, *args):
        fonts.append(text_font)
        return drawn(c, box, size, text_font, *args)

    monkeypatch.setattr(glyphs, "draw_glyph", record)

    def mixed(chance, n=30):
        counts = []
        for seed in range(n):
            fonts.clear()
            handwritten.render_handwritten(
                tokens, "cm", 28, np.random.default_rng(seed), RASTER, font_mix=chance
            )
            assert set(fonts) <= set(glyphs.TEXT_FONTS)
            counts.append(len(set(fonts)))
        return counts

    assert set(mixed(0.0)) == {1}  # one font per expression
    assert min(mixed(1.0)) >= 2  # 12 glyphs each in a font of its own: never all in one
    assert sum(c > 1 for c in mixed(0.1, 60)) > 10  # some expressions mix at a low chance


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_font_mix_is_a_key_of_the_cache_and_of_the_pixels(tmp_path):
    """data.font_mix draws other images under its own cache entry; its default keeps the cache key as it was."""
    plain, other = _own_cache_entry(tmp_path, "font_mix")
    assert any(not np.array_equal(x.image, y.image) for x, y in zip(other["train"], plain["train"]))


def _gaps(tokens, boxes, pairs):
    return np.array([boxes[j, 0] - boxes[i, 2] for i, j in pairs])


def test_spacing_sets_symbols_apart_as_writers_do():
    """data.spacing=1 without jitter: every gap between neighbouring symbols grows by SYMBOL_GAP letter heights;
    a fraction opens by FRACTION_GAPS and its bar still spans its numerator and denominator; a radical still covers
    its argument; 0 draws the default's pixels."""
    tokens = "a + b = \\frac { c d } { e } - \\sqrt { x y } k".split()
    a, plus, b, eq, frac, c, d, e, minus, sqrt, x, y, k = 0, 1, 2, 3, 4, 6, 7, 10, 12, 13, 15, 16, 18

    def draw(amount):
        return handwritten.render_handwritten(
            tokens, "cm", 28, np.random.default_rng(2), RASTER, 0.0, spacing=amount
        )

    (img0, tight), (img1, apart) = draw(0.0), draw(1.0)
    default, _ = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(2), RASTER, 0.0)
    assert np.array_equal(img0, default)
    assert img1.shape[1] > img0.shape[1] and img1.shape[0] > img0.shape[0]  # wider, and the fraction taller
    h = np.median([tight[i, 3] - tight[i, 1] for i in (a, b, c, d, e, x, y, k)])
    pairs = [(a, plus), (plus, b), (b, eq), (c, d), (x, y)]
    grown = _gaps(tokens, apart, pairs) - _gaps(tokens, tight, pairs)
    assert grown == pytest.approx(np.full(len(pairs), placement.SYMBOL_GAP * h), rel=0.15)
    for boxes in (tight, apart):  # the bar under both lines, the radical over its argument
        assert boxes[frac, 0] <= min(boxes[c, 0], boxes[e, 0]) + 1
        assert boxes[frac, 2] >= max(boxes[d, 2], boxes[e, 2]) - 1
        assert boxes[sqrt, 0] < boxes[x, 0] and boxes[sqrt, 2] >= boxes[y, 2] - 1
    assert apart[minus, 0] > apart[frac, 2]  # what follows the fraction is still after it
    # the fraction opened: its numerator higher above the bar, its denominator lower, the bar longer on both sides
    up, down, left, right = (g * h for g in placement.FRACTION_GAPS)
    num0, num1 = tight[frac, 1] - tight[(c, d), 3].max(), apart[frac, 1] - apart[(c, d), 3].max()
    den0, den1 = tight[e, 1] - tight[frac, 3], apart[e, 1] - apart[frac, 3]
    assert num1 - num0 == pytest.approx(up, rel=0.15) and den1 - den0 == pytest.approx(down, rel=0.15)
    reach0 = tight[c, 0] - tight[frac, 0], tight[frac, 2] - tight[d, 2]
    reach1 = apart[c, 0] - apart[frac, 0], apart[frac, 2] - apart[d, 2]
    assert reach1[0] - reach0[0] > 0.8 * left and reach1[1] - reach0[1] > 0.8 * right


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_spacing_is_a_key_of_the_cache_and_of_the_pixels(tmp_path):
    """data.spacing draws wider images of the same labels under its own cache entry; its default keeps the key."""
    plain, other = _own_cache_entry(tmp_path, "spacing")
    wider = [
        x.image.shape[1] > y.image.shape[1]
        for x, y in zip(other["train"], plain["train"])
        if len(x.tokens) > 3
    ]
    assert wider and np.mean(wider) > 0.7


def test_handwritten_splits_are_cached(tmp_path):
    cfg = compose_config(["debug=tiny", "data.style=handwritten", "data.symbols=crohme"]).data
    cfg.cache_dir = str(tmp_path)
    first = synthetic.build_splits(cfg)
    files = list(tmp_path.rglob("splits.npz"))
    assert len(files) == 1
    again = synthetic.build_splits(cfg)
    for split in synthetic.SPLITS:
        assert [s.tokens for s in first[split]] == [s.tokens for s in again[split]]
        assert all(np.array_equal(x.image, y.image) for x, y in zip(first[split], again[split]))
    assert any(not np.isnan(s.boxes).all() for s in first["train"])
    printed = compose_config(["debug=tiny", "data.symbols=crohme"]).data
    printed.cache_dir = str(tmp_path)
    synthetic.build_splits(printed)
    assert len(list(tmp_path.rglob("splits.npz"))) == 2  # another style, another cache entry


def test_experiment_handwritten_tests_on_crohme_folders(tmp_path, cache_dir):
    """experiment=handwritten through train.py: rendered handwriting in, the named CROHME test sets out, each
    reported over all of its files in metrics.json."""
    from test_crohme import QUIRKS, published_layout

    root = published_layout(tmp_path / "CROHME")
    run_dir = tmp_path / "run"
    args = [
        "experiment=handwritten",
        f"data.root={root}",
        "data.num_train=40",
        "data.num_valid=8",
        "data.num_test=8",
        "data.difficulty=1",
        "data.render_workers=1",
        "data.font_size=16",
        "trainer.max_steps=4",
        "trainer.max_minutes=0",
        "trainer.eval_every=4",
        "trainer.checkpoint_every=4",
        "decode.final_beam_size=1",
        "decode.max_len=12",
    ]
    run_train(args, run_dir, cache_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert set(metrics["test_sets"]) == {"2014", "2016"}
    for entry in metrics["test_sets"].values():
        assert entry["total"] == entry["read"] == len(QUIRKS)
    assert metrics["steps"] == 4
    assert metrics["test_scales"] == [1.0, 0.85, 0.7]  # the preset reads each test image at three sizes
    assert metrics["test_length_power"] == 1.0
    # its labels come from the grammar weighed as the CROHME training labels are (data.frequencies=crohme)
    params = [json.loads(str(np.load(f)["params"])) for f in cache_dir.rglob("synthetic/*/splits.npz")]
    assert any(p.get("frequencies") == "crohme" and p["num_train"] == 40 for p in params)
    # the checkpoint tested again by evaluate.py on one of the sets: its own data config, the 2016 entry removed
    from test_evaluate import script

    ckpt = run_dir / "checkpoints" / "best.pt"
    one = script(
        "evaluate.py", ckpt, f"data.root={root}", "~data.test_sets.2016", "--out", tmp_path / "e.json"
    )
    assert one.returncode == 0, one.stderr
    sets = json.loads((tmp_path / "e.json").read_text())["sets"]
    assert list(sets) == ["2014"] and sets["2014"]["total"] == len(QUIRKS)
    assert sets["2014"]["wer"] == pytest.approx(metrics["test_sets"]["2014"]["wer"])


def test_size_jitter_spreads_the_size_of_whole_expressions():
    """data.size_jitter: 0 draws the default's pixels bit for bit, every expression at data.symbol_size; 0.2 draws
    each expression at its own size (the spread of its letters' heights on a log scale near 0.2), the strokes as
    wide as before, and the symbols of one expression in the same proportions."""
    from wapstable.cli import layout

    tokens = "a b + c d = e f g h k m".split()
    default, _ = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(5), RASTER, 0.0)
    still, _ = handwritten.render_handwritten(
        tokens, "cm", 28, np.random.default_rng(5), RASTER, 0.0, size_jitter=0.0
    )
    assert np.array_equal(default, still)

    def sizes(spread, n=40):
        out = []
        for seed in range(n):
            img, boxes = handwritten.render_handwritten(
                tokens, "cm", 28, np.random.default_rng(seed), RASTER, 0.0, size_jitter=spread
            )
            letter_px = layout.measure(tokens, boxes)[("letter px", -1)]  # the median letter height
            out.append((letter_px, boxes[1, 2] - boxes[1, 0], img))
        return out

    fixed, spread = sizes(0.0), sizes(0.2)
    assert np.std(np.log([h for h, _, _ in fixed])) < 0.05  # no spread: one size but for the font drawn
    log_h = np.log([h for h, _, _ in spread])
    assert (
        0.12 < np.std(log_h) < 0.3 and abs(np.mean(log_h) - np.mean(np.log([h for h, _, _ in fixed]))) < 0.1
    )
    # the plus sign keeps its share of the letters' height: the whole expression is scaled, not single glyphs
    ratios = [w / h for h, w, _ in spread]
    assert np.std(ratios) / np.mean(ratios) < 0.02
    # the pen is as wide as before: a bigger expression has more ink, not thicker lines
    big = max(spread, key=lambda r: r[0])[2]
    assert big.shape[0] > fixed[0][2].shape[0] and set(np.unique(big)) <= set(np.unique(default)) | {0, 255}


def test_size_jitter_is_a_key_of_the_cache_and_of_the_pixels(tmp_path):
    """data.size_jitter draws the same labels at other sizes under its own cache entry; its default keeps the key."""
    plain, other = _own_cache_entry(tmp_path, "size_jitter", "data.scale=symbol")
    ratios = [x.image.shape[0] / y.image.shape[0] for x, y in zip(other["train"], plain["train"])]
    assert sum(r > 1.1 for r in ratios) and sum(r < 0.9 for r in ratios)  # some drawn larger, some smaller


BAD_STYLE = [
    (["data.style=cursive"], ["data.style", "handwritten"]),
    (["data.symbols=all"], ["data.symbols", "crohme"]),
    (
        ["data.style=handwritten", "data.height=8"],
        ["error: data.style=handwritten needs", "data.height >= 16"],
    ),
    (["data.style=handwritten", "data.distort=-1"], ["data.distort=-1.0", "must be >= 0"]),
    (["data.style=handwritten", "data.jitter=nan"], ["data.jitter=nan", "must be >= 0"]),
    (["data.jitter=2"], ["data.jitter=2.0 shapes handwritten glyphs", "data.style=handwritten"]),
    (["data.distort=1"], ["data.distort=1.0 shapes handwritten glyphs", "data.style=handwritten"]),
    (
        ["data.allographs=0.5"],
        ["data.allographs=0.5 shapes handwritten glyphs", "data.style=handwritten"],
    ),
    (["data.style=handwritten", "data.allographs=2"], ["data.allographs=2.0 is a chance", "between 0"]),
    (["data.style=handwritten", "data.allographs=-1"], ["data.allographs=-1.0 must be >= 0"]),
    (
        ["data.style=handwritten", "data.script_place=1.5"],
        ["data.script_place=1.5 is a chance", "between 0"],
    ),
    (
        ["data.script_place=1"],
        ["data.script_place=1.0 shapes handwritten glyphs", "data.style=handwritten"],
    ),
    (["data.style=handwritten", "data.font_mix=2"], ["data.font_mix=2.0 is a chance", "between 0"]),
    (["data.font_mix=0.5"], ["data.font_mix=0.5 shapes handwritten glyphs", "data.style=handwritten"]),
    (["data.style=handwritten", "data.more_forms=1.5"], ["data.more_forms=1.5 is a chance", "between 0"]),
    (["data.style=handwritten", "data.spacing=-1"], ["data.spacing=-1.0 must be >= 0"]),
    (["data.spacing=1"], ["data.spacing=1.0 shapes handwritten glyphs", "data.style=handwritten"]),
    (
        ["data.size_jitter=0.2"],
        ["data.size_jitter=0.2 shapes handwritten glyphs", "data.style=handwritten"],
    ),
    (["data.style=handwritten", "data.size_jitter=-0.1"], ["data.size_jitter=-0.1 must be >= 0"]),
    (["data.frequencies=crohme"], ["data.frequencies=crohme weighs", "set data.symbols=crohme"]),
    (["data.symbols=crohme", "data.frequencies=often"], ["data.frequencies", "grammar", "crohme"]),
    (["data.style=handwritten", "data.size_jitter=3"], ["data.size_jitter=3.0 is a spread", "between 0"]),
    (
        ["data.style=handwritten", "data.scale=height", "data.size_jitter=0.2"],
        ["data.size_jitter=0.2 spreads the size", "data.scale=symbol"],
    ),
]


# refused by Hydra's schema (an unknown Enum value) before train() runs: through train.py only
BY_THE_SCHEMA = {0, 1, 20}
# through train.py in make test: the schema's refusals and one of train()'s; the rest under make test-all
BY_TRAIN_PY = BY_THE_SCHEMA | {2}


@pytest.mark.parametrize("args, says", [c for k, c in enumerate(BAD_STYLE) if k not in BY_THE_SCHEMA])
def test_bad_style_values_are_refused(tmp_path, cache_dir, args, says):
    """Each of train()'s refusals, in this process (test_bad_style_values_are_refused_by_train_py: the command)."""
    message = refusal_in_process(args, tmp_path / "run", cache_dir)
    for words in says:
        assert words.removeprefix("error: ") in message


@pytest.mark.parametrize(
    "args, says",
    [c if k in BY_TRAIN_PY else pytest.param(*c, marks=pytest.mark.slow) for k, c in enumerate(BAD_STYLE)],
)
def test_bad_style_values_are_refused_by_train_py(tmp_path, cache_dir, args, says):
    proc = run_train(args, tmp_path / "run", cache_dir, check=False)
    assert proc.returncode != 0
    for words in says:
        assert words in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_make_figures_draws_handwriting_beside_real_ink(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "WAPSTABLE_CACHE", str(tmp_path / "cache")
    )  # the symbol bank of --crohme is cached there
    from test_figures import assert_png
    from test_guidance import INKML

    from wapstable.cli import figures, figures_data

    (tmp_path / "ink").mkdir()
    (tmp_path / "ink" / "a.inkml").write_text(INKML)  # a file whose traceGroups give every symbol's box
    out = tmp_path / "docs"
    assert figures.main(["--only", "handwriting", "--out", str(out), "--crohme", str(tmp_path / "ink")]) == 0
    assert_png(out / "handwriting.png")
    assert list((tmp_path / "cache" / "glyphs").glob("*/bank.npz"))  # the real-symbol panels used it
    panels = figures_data.crohme_panels(tmp_path / "ink", 4, RASTER)
    assert len(panels) == 1 and panels[0][0].shape[0] <= RASTER.height


# -----------------------------------------------------------------------------
# data.glyphs=crohme: real symbols cut from the training files' traceGroups


def ink_folder(root, copies=3):
    """A training folder of InkML whose traceGroups name every symbol: `\\frac{a}{x^2}` written `copies` times."""
    from test_guidance import INKML

    folder = root / "TrainINKML" / "KAIST"
    folder.mkdir(parents=True)
    for i in range(copies):
        (folder / f"k{i}.inkml").write_text(INKML)
    return root / "TrainINKML"


def test_symbols_are_cut_from_the_trace_groups(tmp_path):
    from wapstable.data.ink import bank as ink_bank

    folder = ink_folder(tmp_path)
    tokens, symbols = ink_bank.read_symbols(next(folder.rglob("*.inkml")))
    assert tokens == "\\frac { a } { x ^ { 2 } }".split()
    assert [(t, len(strokes)) for t, strokes in symbols] == [("a", 1), ("-", 1), ("x", 2), ("2", 1)]
    path = ink_bank.bank_path(folder, 0.0, tmp_path / "cache")
    bank = ink_bank.load_bank(str(path))
    assert {t: len(s) for t, s in bank.items()} == {"a": 3, "-": 3, "x": 3, "2": 3}
    assert [s.tolist() for s in bank["x"][0]] == [[[20, 60], [50, 100]], [[50, 60], [20, 100]]]
    # a file whose expression is held out for validation gives no ink: here every file, so nothing is left
    fraction = 0.999999
    assert held_out(tokens, fraction)
    with pytest.raises(DataError, match="no file there has traceGroups"):
        ink_bank.bank_path(folder, fraction, tmp_path / "cache2")


def test_real_symbols_are_drawn_in_the_layout(tmp_path):
    from wapstable.data.ink import bank as ink_bank

    bank = ink_bank.load_bank(str(ink_bank.bank_path(ink_folder(tmp_path), 0.0, tmp_path / "cache")))
    tokens = "x + 2".split()
    real, boxes = handwritten.render_handwritten(
        tokens, "cm", 28, np.random.default_rng(0), RASTER, 0.0, bank
    )
    fonts, _ = handwritten.render_handwritten(tokens, "cm", 28, np.random.default_rng(0), RASTER, 0.0)
    assert not (real.shape == fonts.shape and np.array_equal(real, fonts))
    # the written x (two strokes from (20, 60)-(50, 100) and (50, 60)-(20, 100)) is a cross as tall as it is wide
    x0, y0, x1, y1 = boxes[0]
    assert 0.6 < (x1 - x0) / (y1 - y0) < 1.4
    # + has no sample in this bank: it falls back to the stroke fonts
    assert not np.isnan(boxes[1]).any()


def test_a_run_on_real_symbols_and_its_errors(tmp_path, cache_dir):
    root = ink_folder(tmp_path / "CROHME").parent
    args = ["data.style=handwritten", "data.glyphs=crohme", f"data.root={root}", "data.train=TrainINKML"]
    args.append("data.valid_fraction=0")
    run_train([*args, "data.symbols=crohme"], tmp_path / "run", cache_dir)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 3
    keys = [  # the rendered data's cache is keyed by the bank, itself keyed by the files it was cut from
        json.loads(str(np.load(p)["params"])) for p in (cache_dir / "synthetic").glob("*/splits.npz")
    ]
    assert any(k.get("glyphs") == "crohme" and k.get("glyph_bank") for k in keys)
    bad = ["data.style=handwritten", "data.glyphs=crohme"]  # one through train.py, the others in this process
    proc = run_train(bad, tmp_path / "bad", cache_dir, check=False)
    assert proc.returncode == 2 and "set data.root" in proc.stderr + proc.stdout, proc.stderr[-500:]
    for bad, says in (
        (["data.glyphs=crohme"], "set data.style=handwritten"),
        (["data.style=handwritten", "data.glyphs=crohme", f"data.root={tmp_path}"], "does not exist"),
    ):
        assert says in refusal_in_process(bad, tmp_path / "bad", cache_dir), bad


def test_crohme_pretraining_on_real_symbols_takes_the_run_s_folders(tmp_path, cache_dir):
    """pretrain.data.glyphs=crohme: the pretraining draws with symbols cut from the run's own training folder (its
    data.root, data.train and hold-out), without repeating them under pretrain.data."""
    from test_crohme import published_layout

    root = published_layout(tmp_path / "CROHME_labeled_2016")
    run = tmp_path / "run"
    args = [
        "data=crohme",
        f"data.root={root}",
        "data.height=32",
        "pretrain.steps=2",
        "pretrain.eval_every=2",
        "+pretrain.data.style=handwritten",
        "+pretrain.data.symbols=crohme",
        "+pretrain.data.glyphs=crohme",
    ]
    run_train(args, run, cache_dir)
    assert json.loads((run / "pretrain" / "metrics.json").read_text())["steps"] == 2
    # the bank of the run's TrainINKML keys the pretraining's rendered data
    from wapstable.data.ink.bank import bank_path

    bank = bank_path(root / "TrainINKML", 0.05, cache_dir)  # data=crohme's hold-out
    keys = [json.loads(str(np.load(p)["params"])) for p in (cache_dir / "synthetic").glob("*/splits.npz")]
    assert bank.parent.name in {k.get("glyph_bank") for k in keys}


def test_pretrain_mix_puts_rendered_expressions_into_the_real_training_split(
    tmp_path, cache_dir, monkeypatch
):
    """pretrain.mix=N: N rendered expressions of the pretraining's data join the CROHME training split (no
    pretraining needed; a MixSource of the two sources), a validation label among them is left out, and the run
    trains on both."""
    from conftest import compose_config
    from test_crohme import published_layout

    from wapstable.data.batches import load_splits
    from wapstable.data.sources import mix
    from wapstable.data.sources.base import DataSource
    from wapstable.train.build import mixed_source

    root = published_layout(tmp_path / "CROHME_labeled_2016")
    args = [
        "data=crohme",
        f"data.root={root}",
        "data.height=32",
        "data.valid_fraction=0.3",
        "pretrain.mix=6",
        "+pretrain.data.style=handwritten",
        "+pretrain.data.symbols=crohme",
    ]
    run = tmp_path / "run"
    log = run_train(args, run, cache_dir).stdout
    real = load_splits(compose_config([*args, f"data.cache_dir={cache_dir}"]).data)
    assert "pretrain.mix: 6 rendered expressions in the training split" in log
    assert f"data: crohme, {len(real['train']) + 6} train / {len(real['valid'])} valid" in log
    assert not (run / "pretrain").exists()  # the mix alone pretrains nothing

    # a rendered expression whose label is a validation label is left out
    cfg = compose_config([*args, "debug=tiny", f"data.cache_dir={cache_dir}"])
    source = mixed_source(cfg)
    rendered = mix.source_of(source.extra_cfg).splits(source.extra_cfg, ["train"])["train"]
    assert len(rendered) == 6 and all(s.boxes is not None for s in rendered)
    assert all(s.image.dtype == np.uint8 and s.image.shape[0] <= 32 for s in rendered)  # the run's raster
    held = [rendered[0], rendered[3]]

    class Base(DataSource):  # a base source whose validation labels are two of the rendered ones
        def splits(self, cfg_data, which):
            return {k: {"train": [], "valid": held, "test": []}[k] for k in which}

    real_source_of = mix.source_of
    monkeypatch.setattr(mix, "source_of", lambda c: Base() if c is cfg.data else real_source_of(c))
    kept = source.splits(cfg.data, ["train"])
    assert set(kept) == {"train"} and all(s.id.startswith("rendered-") for s in kept["train"])
    assert [s.tokens for s in kept["train"]] == [
        s.tokens for s in rendered if s.tokens not in (held[0].tokens, held[1].tokens)
    ]

    for bad, says in (
        (["pretrain.mix=-1"], "pretrain.mix=-1 must be >= 0"),
        (["data=synthetic", "pretrain.mix=4"], "data=synthetic is rendered already"),
        (["pretrain.mix=-1", "pretrain.steps=2", "pretrain.eval_every=2"], "pretrain.mix=-1 must be >= 0"),
    ):
        proc = run_train([*args, *bad], tmp_path / "bad", cache_dir, check=False)
        assert proc.returncode == 2 and says in proc.stderr + proc.stdout, (bad, proc.stderr[-500:])
        assert not (tmp_path / "bad" / "pretrain").exists()  # refused before the pretraining wrote anything


# "a + \frac{b}{c}" in ink: a, +, then a bar with b above and c below it, each a traceGroup naming its MathML symbol
LAYOUT_INKML = """<ink xmlns="http://www.w3.org/2003/InkML">
<annotation type="truth">$a+\\frac{b}{c}$</annotation>
<annotationXML type="truth" encoding="Content-MathML">
<math xmlns="http://www.w3.org/1998/Math/MathML"><mrow><mi xml:id="a">a</mi><mo xml:id="p">+</mo>
<mfrac xml:id="bar"><mi xml:id="b">b</mi><mi xml:id="c">c</mi></mfrac></mrow></math></annotationXML>
<trace id="0">0 40, 20 40, 20 60, 0 60, 0 40</trace>
<trace id="1">30 50, 50 50</trace>
<trace id="2">40 40, 40 60</trace>
<trace id="3">60 50, 110 50</trace>
<trace id="4">75 20, 75 44, 95 44, 95 32, 75 32</trace>
<trace id="5">95 56, 75 56, 75 76, 95 76</trace>
<traceGroup xml:id="seg"><annotation type="truth">Segmentation</annotation>
<traceGroup xml:id="g0"><annotation type="truth">a</annotation><traceView traceDataRef="0"/><annotationXML href="a"/></traceGroup>
<traceGroup xml:id="g1"><annotation type="truth">+</annotation><traceView traceDataRef="1"/><traceView traceDataRef="2"/><annotationXML href="p"/></traceGroup>
<traceGroup xml:id="g2"><annotation type="truth">-</annotation><traceView traceDataRef="3"/><annotationXML href="bar"/></traceGroup>
<traceGroup xml:id="g3"><annotation type="truth">b</annotation><traceView traceDataRef="4"/><annotationXML href="b"/></traceGroup>
<traceGroup xml:id="g4"><annotation type="truth">c</annotation><traceView traceDataRef="5"/><annotationXML href="c"/></traceGroup>
</traceGroup></ink>"""


def test_layout_stats_compares_ink_with_its_drawing(tmp_path, capsys):
    """scripts/layout_stats.py: the same places measured in the ink and in its label drawn again; data.spacing=1
    opens the drawn fractions and gaps, and leaves the ink's figures as they are."""
    from wapstable.cli import layout

    folder = tmp_path / "TrainINKML"
    folder.mkdir()
    for k in range(4):
        (folder / f"f{k}.inkml").write_text(LAYOUT_INKML)
    # a file without traceGroups has no symbol boxes: skipped
    bare = LAYOUT_INKML[: LAYOUT_INKML.index("<traceGroup")] + "</ink>"
    (folder / "no_groups.inkml").write_text(bare)
    # the fonts' own forms, so that only the spacing differs between the two drawings (the preset's other forms vary
    # the glyphs' widths within their boxes)
    fixed = ["data.script_place=0", "data.allographs=0", "data.more_forms=0"]
    tight = layout.compare(folder, ["data.spacing=0", *fixed], files=5, seed=0)
    apart = layout.compare(folder, ["data.spacing=1", *fixed], files=5, seed=0)
    assert tight["gap"]["n"] == 4 * 1 and tight["frac up"]["n"] == 4  # a-+ (the + and the bar: not symbols)
    assert tight["gap"]["real"] == apart["gap"]["real"]
    # b ends 6 units above the bar, letters are about 20 high: 0.3 less the boxes' padding
    assert tight["frac up"]["real"][1] == pytest.approx(6 / 20, abs=0.15)
    for m in ("gap", "frac up", "frac down", "frac left"):
        assert apart[m]["drawn"][1] > tight[m]["drawn"][1] + 0.1, m
    # letter px: one per expression, in pixels; data.size_jitter spreads the drawn sizes, not the ink's
    spread = layout.compare(folder, ["data.size_jitter=0.5", "data.spacing=0", *fixed], files=5, seed=0)
    assert tight["letter px"]["n"] == 4 and spread["letter px"]["real"] == tight["letter px"]["real"]

    def ratio(row):
        return row["drawn"][2] / row["drawn"][0]

    assert ratio(spread["letter px"]) > ratio(tight["letter px"]) + 0.2
    assert layout.main([str(folder), "--files", "3", "--out", str(tmp_path / "t.json")]) == 0
    printed = capsys.readouterr().out
    assert (
        "frac up" in printed and json.loads((tmp_path / "t.json").read_text())["gap"]["n"] == 3
    )  # f0, f1, f3 of the five
    with pytest.raises(UserError, match="no .inkml files"):
        layout.compare(tmp_path / "empty", [], files=10, seed=0)
