"""The synthetic data source: grammar, mathtext rendering, splits and their on-disk cache."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from wapstable.data.render import grammar, mathtext
from wapstable.data.sample import Sample
from wapstable.data.sources import synthetic

STRUCTURED = ("\\frac", "\\sqrt", "_", "^")  # each must be followed by a { ... } group


def make_cfg(tmp_path, name="cache", **overrides):
    cfg = dict(
        num_train=24,
        num_valid=8,
        num_test=8,
        difficulty=2,
        fonts=list(mathtext.FONTS),
        font_size=16,
        augment=True,
        seed=0,
        render_workers=1,
        cache_dir=str(tmp_path / name),
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def fake_render(tokens, font, font_size, rng, augment):
    return np.full((3, 1 + len(tokens)), 255, np.uint8)


def cache_files(tmp_path, name="cache"):
    return sorted((tmp_path / name / "synthetic").glob("*/splits.npz"))


def same_splits(a, b):
    assert a.keys() == b.keys() == set(synthetic.SPLITS)
    for split in synthetic.SPLITS:
        assert len(a[split]) == len(b[split])
        for x, y in zip(a[split], b[split]):
            assert x.id == y.id and x.tokens == y.tokens
            assert x.image.shape == y.image.shape and x.image.tobytes() == y.image.tobytes()


# -----------------------------------------------------------------------------
# grammar


def test_generate_expressions_is_deterministic_and_distinct():
    a = grammar.generate_expressions(200, seed=3, difficulty=2)
    assert a == grammar.generate_expressions(200, seed=3, difficulty=2)
    assert a != grammar.generate_expressions(200, seed=4, difficulty=2)
    assert len(a) == 200 and len({" ".join(t) for t in a}) == 200
    # one token per list item, as a whitespace-separated WAP caption and dictionary need
    assert all(tok and not any(c.isspace() for c in tok) for t in a for tok in t)


def test_difficulty_2_is_short_but_full_of_structures():
    exprs = grammar.generate_expressions(500, seed=0, difficulty=2)
    lengths = np.array([len(t) for t in exprs])
    assert 3 <= np.median(lengths) <= 15
    assert (lengths <= 25).mean() >= 0.9
    assert np.mean(["\\frac" in t for t in exprs]) >= 0.2
    assert np.mean(["^" in t or "_" in t for t in exprs]) >= 0.2
    assert np.mean(["\\sqrt" in t for t in exprs]) >= 0.2


def test_difficulty_sets_structure_and_length():
    flat = grammar.generate_expressions(300, seed=0, difficulty=1)
    assert not any(tok in STRUCTURED + ("{", "}") for t in flat for tok in t)
    means = [np.mean([len(t) for t in grammar.generate_expressions(200, 0, d)]) for d in (1, 2, 3, 4)]
    assert means == sorted(means) and means[3] > 2 * means[1]
    deep = grammar.generate_expressions(300, seed=0, difficulty=4)
    assert any(t.count("\\frac") >= 2 for t in deep) and any("\\sum" in t or "\\int" in t for t in deep)
    with pytest.raises(ValueError, match="difficulty"):
        grammar.generate_expressions(1, seed=0, difficulty=5)


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_tokens_are_crohme_style(difficulty):
    for tokens in grammar.generate_expressions(300, seed=1, difficulty=difficulty):
        depth = 0
        for i, tok in enumerate(tokens):
            depth += (tok == "{") - (tok == "}")
            assert depth >= 0, tokens
            if tok in STRUCTURED:
                assert tokens[i + 1] == "{", tokens
        assert depth == 0, tokens


def test_tokens_to_mathtext_glues_tokens():
    # a blank before ^ would make mathtext set the exponent full size
    assert mathtext.tokens_to_mathtext(["x", "^", "{", "2", "}"]) == "$x^{2}$"
    assert mathtext.tokens_to_mathtext(["\\frac", "{", "a", "}", "{", "b", "}"]) == "$\\frac{a}{b}$"
    # but a command word must not swallow the next letter
    assert mathtext.tokens_to_mathtext(["2", "\\pi", "r"]) == "$2\\pi r$"
    assert mathtext.tokens_to_mathtext(["\\{", "x", "\\}"]) == "$\\{x\\}$"


# -----------------------------------------------------------------------------
# rendering


def test_every_token_renders_in_every_font(caplog):
    # Missing glyphs are a font matter, so every terminal is rendered in every font; mathtext only logs them.
    terminals = (
        grammar.DIGITS
        + grammar.LETTERS
        + grammar.GREEK
        + grammar.OPERATORS
        + grammar.RELATIONS
        + [b for pair in grammar.BRACKETS for b in pair]
    )
    tokens = [
        *terminals,
        "\\sum",
        "_",
        "{",
        "i",
        "=",
        "1",
        "}",
        "^",
        "{",
        "\\infty",
        "}",
        "\\int",
        "x",
        "d",
        "x",
    ]
    tokens += ["\\sqrt", "{", "\\frac", "{", "a", "}", "{", "b", "}", "}"]
    with caplog.at_level(logging.WARNING, logger="matplotlib.mathtext"):
        for font in mathtext.FONTS:
            img = mathtext.render(tokens, font, 16, None, augment=False)
            assert img.dtype == np.uint8 and img.ndim == 2 and (img == 255).any()
    assert not caplog.records, [r.getMessage()[:200] for r in caplog.records]


@pytest.mark.parametrize("difficulty,n", [(1, 300), (2, 300), (3, 200), (4, 100)])
def test_every_label_renders(difficulty, n, caplog):
    # parse errors do not depend on the font, so the fonts take turns to keep the test fast
    exprs = grammar.generate_expressions(n, seed=11, difficulty=difficulty)
    with caplog.at_level(logging.WARNING, logger="matplotlib.mathtext"):
        for i, tokens in enumerate(exprs):
            img = mathtext.render(tokens, mathtext.FONTS[i % len(mathtext.FONTS)], 16, None, augment=False)
            assert img.ndim == 2 and img.max() >= 128, tokens  # ink, if anti-aliased
    assert not caplog.records, [r.getMessage()[:200] for r in caplog.records]


def test_render_image_is_cropped_uint8_with_ink():
    tokens = ["\\frac", "{", "a", "+", "1", "}", "{", "2", "}", "=", "x", "^", "{", "2", "}"]
    m = mathtext.MARGIN
    for augment in (False, True):
        img = mathtext.render(tokens, "cm", 16, np.random.default_rng(0), augment)
        assert img.dtype == np.uint8 and img.ndim == 2
        assert 20 <= img.shape[0] <= 70 and 30 <= img.shape[1] <= 300, img.shape
        assert img.max() >= 128 and img.mean() < 64  # ink is bright on a dark background
        # tight crop: only the margin is empty, and the ink touches it on every side
        inner = img[m:-m, m:-m]
        assert img.sum() == inner.sum()
        assert inner[0].any() and inner[-1].any() and inner[:, 0].any() and inner[:, -1].any()


def test_augmentation_is_seeded_and_changes_the_image():
    tokens = ["\\sqrt", "{", "x", "}", "+", "y", "_", "{", "i", "}"]
    a = mathtext.render(tokens, "stix", 16, np.random.default_rng(5), augment=True)
    b = mathtext.render(tokens, "stix", 16, np.random.default_rng(5), augment=True)
    c = mathtext.render(tokens, "stix", 16, np.random.default_rng(6), augment=True)
    clean = mathtext.render(tokens, "stix", 16, None, augment=False)
    assert a.tobytes() == b.tobytes() and a.shape == b.shape
    assert a.shape != c.shape or a.tobytes() != c.tobytes()
    assert a.shape != clean.shape or a.tobytes() != clean.tobytes()
    assert clean.tobytes() == mathtext.render(tokens, "stix", 16, None, augment=False).tobytes()


def test_fonts_differ_and_unknown_font_fails():
    tokens = ["\\alpha", "+", "\\frac", "{", "1", "}", "{", "x", "}"]
    images = {mathtext.render(tokens, f, 16, None, False).tobytes() for f in mathtext.FONTS}
    assert len(images) == len(mathtext.FONTS)
    with pytest.raises(ValueError):
        mathtext.render(tokens, "comic", 16, None, False)


# -----------------------------------------------------------------------------
# splits and cache


def test_build_splits_is_deterministic_and_independent_of_workers(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="wapstable.data.sources.synthetic"):
        a = synthetic.build_splits(make_cfg(tmp_path, "a", render_workers=1))
    assert any(
        "rendered 40 images in" in r.getMessage() and "images/s" in r.getMessage() for r in caplog.records
    )
    b = synthetic.build_splits(make_cfg(tmp_path, "b", render_workers=2))
    same_splits(a, b)
    assert [len(a[s]) for s in synthetic.SPLITS] == [24, 8, 8]
    assert a["train"][0].id == "train-000000" and a["test"][7].id == "test-000007"
    for samples in a.values():
        for s in samples:
            assert isinstance(s, Sample) and s.image.dtype == np.uint8 and s.image.ndim == 2
            assert s.image.max() >= 128
    other = synthetic.build_splits(make_cfg(tmp_path, "c", seed=1))
    assert [s.tokens for s in other["train"]] != [s.tokens for s in a["train"]]


def test_splits_share_no_expression(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "render", fake_render)
    # difficulty 1 has the smallest space of expressions, so collisions are likeliest there
    cfg = make_cfg(tmp_path, num_train=1500, num_valid=300, num_test=300, difficulty=1)
    splits = synthetic.build_splits(cfg)
    keys = {split: {" ".join(s.tokens) for s in samples} for split, samples in splits.items()}
    assert [len(keys[s]) for s in synthetic.SPLITS] == [1500, 300, 300]
    assert not keys["train"] & keys["valid"] and not keys["train"] & keys["test"]
    assert not keys["valid"] & keys["test"]


def test_more_training_data_leaves_valid_and_test_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "render", fake_render)
    small = synthetic.build_splits(make_cfg(tmp_path, num_train=20))
    large = synthetic.build_splits(make_cfg(tmp_path, num_train=60))
    for split in ("valid", "test"):
        assert [s.tokens for s in small[split]] == [s.tokens for s in large[split]]
    assert [s.tokens for s in large["train"][:20]] == [s.tokens for s in small["train"]]
    assert len(cache_files(tmp_path)) == 2


def test_second_build_loads_the_cache(tmp_path, monkeypatch, caplog):
    cfg = make_cfg(tmp_path)
    first = synthetic.build_splits(cfg)
    assert len(cache_files(tmp_path)) == 1

    def no_render(*args, **kwargs):
        raise AssertionError("rendered although the cache holds these splits")

    monkeypatch.setattr(synthetic, "render", no_render)
    # neither the worker count nor the cache location is part of what the data is
    with caplog.at_level(logging.INFO, logger="wapstable.data.sources.synthetic"):
        again = synthetic.build_splits(make_cfg(tmp_path, render_workers=3))
    same_splits(first, again)
    assert any("loaded synthetic splits" in r.getMessage() for r in caplog.records)
    # a parameter that changes the data gets its own cache entry
    monkeypatch.setattr(synthetic, "render", fake_render)
    synthetic.build_splits(make_cfg(tmp_path, font_size=20))
    assert len(cache_files(tmp_path)) == 2


def test_cache_holds_no_pickles(tmp_path):
    synthetic.build_splits(make_cfg(tmp_path))
    (path,) = cache_files(tmp_path)
    with np.load(path, allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    assert not list(path.parent.glob("*.tmp"))  # the temporary file was renamed, not left behind


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_count"])
def test_corrupt_cache_is_rendered_again(tmp_path, caplog, damage):
    cfg = make_cfg(tmp_path)
    first = synthetic.build_splits(cfg)
    (path,) = cache_files(tmp_path)
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not an npz file" * 10)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["test_tokens"] = arrays["test_tokens"][:-1]
        arrays["test_shapes"] = arrays["test_shapes"][:-1]
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    with caplog.at_level(logging.WARNING, logger="wapstable.data.sources.synthetic"):
        again = synthetic.build_splits(cfg)
    assert any("rendering it again" in r.getMessage() for r in caplog.records)
    same_splits(first, again)
    # and the cache is whole again
    with np.load(path, allow_pickle=False) as z:
        assert len(z["test_tokens"]) == cfg.num_test
