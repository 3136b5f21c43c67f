import logging

import numpy as np
import pytest

from wapstable.data.ink.inkml import parse_trace
from wapstable.data.ink.raster import Raster, rasterize_traces
from wapstable.data.ink.read import read_inkml
from wapstable.data.latex import (
    CROHME_2014_SYMBOLS,
    DataError,
    crohme_vocab,
    normalize_crohme,
    tokenize_latex,
)
from wapstable.data.sources.crohme import load_crohme_split
from wapstable.errors import UserError

# ---------------------------------------------------------------------------------------------------------------
# tokenising and normalising


def test_tokenize_latex():
    assert tokenize_latex(r"\frac{12}{x}") == ["\\frac", "{", "1", "2", "}", "{", "x", "}"]
    assert tokenize_latex(r"  \alpha+\beta ") == ["\\alpha", "+", "\\beta"]
    assert tokenize_latex(r"\{a\}") == ["\\{", "a", "\\}"]
    assert tokenize_latex(r"a\,b\;c") == ["a", "\\,", "b", "\\;", "c"]
    assert tokenize_latex(r"\sin x") == ["\\sin", "x"]
    assert tokenize_latex("sin") == ["s", "i", "n"]
    assert tokenize_latex(r"\alpha2") == ["\\alpha", "2"]  # a command name is letters only
    assert tokenize_latex(r"f'(x)") == ["f", "'", "(", "x", ")"]
    assert tokenize_latex("") == []


def norm(s: str) -> str:
    return " ".join(normalize_crohme(tokenize_latex(s)))


@pytest.mark.parametrize(
    "truth, expected",
    [
        (r"$x^2$", "x ^ { 2 }"),
        (r"$x^{2}$", "x ^ { 2 }"),
        (r"$x_1^2$", "x _ { 1 } ^ { 2 }"),
        (r"$x^10$", "x ^ { 1 } 0"),  # as TeX reads it: only the first digit is raised
        (r"$a^{b^c}$", "a ^ { b ^ { c } }"),
        (r"$\frac12$", "\\frac { 1 } { 2 }"),
        (r"$\frac{a}{b}$", "\\frac { a } { b }"),
        (r"$\frac\alpha{x+1}$", "\\frac { \\alpha } { x + 1 }"),
        (r"$\dfrac{1}{2}$", "\\frac { 1 } { 2 }"),
        (r"$x^\frac{1}{2}$", "x ^ { \\frac { 1 } { 2 } }"),
        (r"$\sqrt x$", "\\sqrt { x }"),
        (r"$\sqrt{x+1}$", "\\sqrt { x + 1 }"),
        (r"$\sqrt[3]{x}$", "\\sqrt [ 3 ] { x }"),
        (r"$\sqrt[n]x$", "\\sqrt [ n ] { x }"),
        (r"$\left( a+b \right)^{2}$", "( a + b ) ^ { 2 }"),
        (r"$\left\{ x \right.$", "\\{ x"),
        (r"$\left. \frac{df}{dx} \right|_{x=0}$", "\\frac { d f } { d x } | _ { x = 0 }"),
        (r"$\left[ x \right]$", "[ x ]"),
        (r"$\left\lbrace a \right\rbrace$", "\\{ a \\}"),
        (r"$\bigl( x \bigr)$", "( x )"),
        (r"$a \lt b \gt c$", "a < b > c"),
        (r"$a\ne b$", "a \\neq b"),
        (r"$a \le b \ge c$", "a \\leq b \\geq c"),
        (r"$x \to 0$", "x \\rightarrow 0"),
        (r"$1 + \dots + n$", "1 + \\ldots + n"),
        (r"$1 + \cdots + n$", "1 + \\cdots + n"),  # WAP's dictionary has both
        (r"$\displaystyle\sum_{i=1}^{n} i$", "\\sum _ { i = 1 } ^ { n } i"),
        (
            r"$\lim\limits_{x\to0}\frac{\sin x}{x}=1$",
            "\\lim _ { x \\rightarrow 0 } \\frac { \\sin x } { x } = 1",
        ),
        (r"$\int_0^\infty e^{-x^2}\,dx$", "\\int _ { 0 } ^ { \\infty } e ^ { - x ^ { 2 } } d x"),
        (r"$a \quad b\;c\!d$", "a b c d"),
        (r"$\mbox{if } x$", "i f x"),
        (r"$\mathrm{d}x$", "d x"),
        (r"$e^\mathrm{T}$", "e ^ { T }"),
        (r"$\{ a \}$", "\\{ a \\}"),
        (r"$\frac{-b+\sqrt{b^2-4ac}}{2a}$", "\\frac { - b + \\sqrt { b ^ { 2 } - 4 a c } } { 2 a }"),
        (r"$\sin^2\theta+\cos^2\theta=1$", "\\sin ^ { 2 } \\theta + \\cos ^ { 2 } \\theta = 1"),
        (r"$f^{'}(x)$", "f ^ { ' } ( x )"),
        (r"$\log_2 8 = 3$", "\\log _ { 2 } 8 = 3"),
        (r"$$ 2\times3 $$", "2 \\times 3"),
        # repairs of what the published truths get wrong, as a person reading the ink would
        (r"$M\ltN$", "M < N"),  # a command glued to the next letter (a training truth)
        (r"$\sinx$", "\\sin x"),
        (r"$ \lim \limits _ {y \rightarrow x}} f (y)$", "\\lim _ { y \\rightarrow x } f ( y )"),  # doubled }
        (r"$ \sqrt {648 + 648} ABOVE {4} + 8 $", "\\sqrt [ 4 ] { 6 4 8 + 6 4 8 } + 8"),  # the 4th root
        (r"$ \sqrt {\sqrt {x} ABOVE {n}} ABOVE {m} $", "\\sqrt [ m ] { \\sqrt [ n ] { x } }"),
        (
            r"$ \frac {\sqrt {x}} {2} - \sqrt {3} ABOVE {\sqrt} BELOW {2 \sqrt {x}} $",
            "\\frac { \\sqrt { x } } { 2 } - \\frac { \\sqrt { 3 } } { 2 \\sqrt { x } }",
        ),
        (r"$ | x \parallel y | = | x y | $", "| x | | y | = | x y |"),
        (r"$ 0 \leq x \leq 2 \Pi $", "0 \\leq x \\leq 2 \\pi"),
        (r"$ABOVE$", "A B O V E"),  # the word only means a layout before a group
        # one spelling per expression, as the ink shows it: grouping braces are invisible, and so is the order
        # in which a base's two scripts were typed
        (r"${v_0}^2$", "v _ { 0 } ^ { 2 }"),
        (r"$\frac{{v_0}^2}{2a}$", "\\frac { v _ { 0 } ^ { 2 } } { 2 a }"),
        (r"$2{k}{\pi}$", "2 k \\pi"),
        (r"$\log{x}+{}y$", "\\log x + y"),
        (r"${\sqrt{15}}$", "\\sqrt { 1 5 }"),
        (r"$x^{{2}}$", "x ^ { 2 }"),  # an argument keeps its own braces only
        (r"$x^2_1$", "x _ { 1 } ^ { 2 }"),
        (r"$\int^{b}_{a} f$", "\\int _ { a } ^ { b } f"),
        (r"$\sum^{n}_{i=1} {x_i}^2$", "\\sum _ { i = 1 } ^ { n } x _ { i } ^ { 2 }"),
        (r"$x_1^2_3$", "x _ { 1 } ^ { 2 } _ { 3 }"),  # not TeX: left as written
        (r"$ {x+1} ABOVE {\sqrt} BELOW {2} $", "\\frac { x + 1 } { 2 }"),
    ],
)
def test_normalize_crohme(truth, expected):
    assert norm(truth) == expected


@pytest.mark.parametrize(
    "bad, why",
    [
        ("x^", "\\^ without an argument"),
        ("{x", "unclosed"),
        ("x}", "unmatched"),
        ("}x", "unmatched"),
        (r"x ABOVE {2}", "not a square root"),
        (r"\frac{1}", "frac without"),
    ],
)
def test_normalize_rejects_broken_latex(bad, why):
    with pytest.raises(DataError, match=why):
        norm(bad)


def test_check_labels(caplog):
    """The trainer's check of every split against its vocabulary: a label with an unknown token is skipped with
    its reason, or stops the run naming the sample."""
    from wapstable.data.batches import check_labels
    from wapstable.data.sample import Sample
    from wapstable.data.vocab import Vocab

    vocab = Vocab(["<eol>", "x", "^", "{", "}", "2"])
    good = Sample("good", np.ones((2, 2), np.uint8), ["x", "^", "{", "2", "}"])
    bad = Sample("bad7", np.ones((2, 2), np.uint8), ["x", "+", "\\alpha"])
    with caplog.at_level(logging.WARNING):
        kept = check_labels([good, bad], vocab, "skip")
    assert [s.id for s in kept] == ["good"]
    [said] = [r.getMessage() for r in caplog.records if "bad7" in r.getMessage()]
    assert "'+'" in said and "not in the vocabulary" in said
    with pytest.raises(UserError, match="bad7"):
        check_labels([good, bad], vocab, "fail")


# ---------------------------------------------------------------------------------------------------------------
# InkML

INKML = """<?xml version="1.0" encoding="UTF-8"?>
<ink xmlns="http://www.w3.org/2003/InkML">
  <traceFormat><channel name="X" type="decimal"/><channel name="Y" type="decimal"/></traceFormat>
  <annotation type="writer">w1</annotation>
  <annotation type="truth">{truth}</annotation>
  {traces}
  <traceGroup xml:id="9">
    <annotation type="truth">Segmentation</annotation>
    <traceGroup xml:id="10"><annotation type="truth">x</annotation><traceView traceDataRef="0"/></traceGroup>
  </traceGroup>
</ink>
"""

# an "x" (two strokes, x y points with float coordinates and untidy whitespace) and a "2" (x y t points)
TRACES = """<trace id="0">
  10.5 10.25, 20 20,30.0 30.5 </trace>
  <trace id="1">30 10, 10 30,</trace>
  <trace id="2">40 5 0, 50 4 1, 55 10 2, 42 30 3, 56 30 4</trace>"""


def write(path, truth=r"$x^2$", traces=TRACES, text=None):
    path.write_text(text if text is not None else INKML.format(truth=truth, traces=traces), encoding="utf-8")
    return path


def test_parse_trace():
    assert parse_trace(" 1 2, 3.5 4 ,").tolist() == [[1.0, 2.0], [3.5, 4.0]]
    assert parse_trace("1 2 100, 3 4 200").tolist() == [[1.0, 2.0], [3.0, 4.0]]  # time dropped
    assert parse_trace("-1.5e1 2").tolist() == [[-15.0, 2.0]]
    with pytest.raises(ValueError):
        parse_trace("1 2, 3")
    with pytest.raises(ValueError):
        parse_trace("1 a")


def test_read_inkml(tmp_path):
    s = read_inkml(write(tmp_path / "expr_001.inkml"), Raster(48, 2))
    assert s.id == "expr_001"
    assert s.tokens == ["x", "^", "{", "2", "}"]  # the expression's truth, not the traceGroup's "x"
    assert s.image.dtype == np.uint8 and s.image.ndim == 2
    assert s.image.shape[0] == 48 and s.image.shape[1] > 0
    assert s.image.max() == 255 and s.image.min() == 0
    # ink spans the box: rows up to the margin are empty, the middle is not
    rows = np.flatnonzero(s.image.any(1))
    assert rows[0] <= 6 and rows[-1] >= 41
    assert not s.image[:2].any() and not s.image[-2:].any()


def test_read_inkml_without_namespace(tmp_path):
    text = '<ink><annotation type="truth">$a$</annotation><trace>0 0, 5 9</trace></ink>'
    s = read_inkml(write(tmp_path / "plain.inkml", text=text), Raster(32, 1))
    assert s.tokens == ["a"] and s.image.any()


def test_rasterize_shape_and_aspect():
    square = [np.array([[0, 0], [100, 100]]), np.array([[0, 100], [100, 0]])]
    img = rasterize_traces(square, height=40, line_width=1, margin=4)
    assert img.shape == (40, 32 + 8 + 1)  # 32 px of ink plus the margins, as wide as tall
    bars = [np.array([[0, 0], [0, 100]]), np.array([[400, 0], [400, 100]])]
    wide = rasterize_traces(bars, height=40, line_width=1, margin=4)
    assert wide.shape == (40, 128 + 8 + 1)
    assert img.dtype == np.uint8 and set(np.unique(img)) <= {0, 255} and img.any()


def test_rasterize_line_width():
    traces = [np.array([[0, 0], [50, 80], [100, 0]], float)]
    thin = rasterize_traces(traces, 64, line_width=1)
    thick = rasterize_traces(traces, 64, line_width=5)
    assert thin.shape == thick.shape
    assert (thick > 0).sum() > 3 * (thin > 0).sum()


def test_rasterize_degenerate_ink():
    # a flat stroke (a lone minus) has zero height: it must not divide by zero nor become enormous
    # and is drawn at symbol size, as long as the box is tall
    flat = rasterize_traces([np.array([[0, 5], [100, 5]])], height=32, line_width=2, margin=4)
    assert flat.shape == (32, 24 + 8 + 1) and flat[16].any() and not flat[:12].any()
    # a single point, and a trace of repeated points, are dots
    dot = rasterize_traces([np.array([[7.0, 7.0]])], height=32, line_width=3)
    assert dot.shape[0] == 32 and dot.any()
    same = rasterize_traces([np.array([[1, 1], [1, 1]]), np.array([[0, 0], [0, 20]])], 32, 1)
    assert same.any()
    # an extremely long, thin ink is capped in width
    ticks = [np.array([[0, 0], [0, 1]]), np.array([[1e6, 0], [1e6, 1]])]
    long = rasterize_traces(ticks, height=32, line_width=1, max_aspect=10)
    assert long.shape == (32, 10 * 32 + 1)
    with pytest.raises(ValueError):
        rasterize_traces([], 32, 1)
    with pytest.raises(ValueError):
        rasterize_traces([np.array([[0, np.nan], [1, 1]])], 32, 1)


@pytest.mark.parametrize(
    "name, kwargs, why",
    [
        ("malformed.inkml", {"text": "<ink><trace>1 2, 3 4</trace>"}, "not readable InkML"),
        ("notruth.inkml", {"text": "<ink><trace>1 2, 3 4</trace></ink>"}, "truth"),
        ("emptytruth.inkml", {"truth": "$ $"}, "truth"),
        ("notraces.inkml", {"traces": ""}, "no <trace>"),
        ("emptytrace.inkml", {"traces": '<trace id="0">  </trace>'}, "no <trace>"),
        ("badpoint.inkml", {"traces": '<trace id="0">1 2, 3</trace>'}, "trace '0'"),
        ("badtruth.inkml", {"truth": "$x^{2$"}, "does not parse"),
    ],
)
def test_bad_inkml_names_the_file(tmp_path, name, kwargs, why):
    path = write(tmp_path / name, **kwargs)
    with pytest.raises(DataError, match=why) as e:
        read_inkml(path, Raster(32, 1))
    assert name in str(e.value)


def test_load_split_fail_and_skip(tmp_path, caplog):
    for i in range(3):
        write(tmp_path / f"good{i}.inkml", truth=rf"$x^{i}$")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "good3.inkml", truth=r"$\frac{1}{2}$")  # recursive
    write(tmp_path / "bad_xml.inkml", text="<ink>")
    write(tmp_path / "bad_truth.inkml", text="<ink><trace>1 2, 3 4</trace></ink>")
    (tmp_path / "notes.txt").write_text("not inkml")

    with pytest.raises(DataError, match="bad_truth.inkml"):  # sorted: bad_truth comes first
        load_crohme_split(tmp_path, Raster(32, 1), "fail")

    with caplog.at_level(logging.WARNING):
        samples, errors, total = load_crohme_split(tmp_path, Raster(32, 1), "skip")
    assert sorted(s.id for s in samples) == ["good0", "good1", "good2", "good3"]
    assert next(s for s in samples if s.id == "good3").tokens == ["\\frac", "{", "1", "}", "{", "2", "}"]
    assert total == 6 and len(errors) == 2
    assert dict(errors).keys() == {"malformed XML", "no truth"}
    assert any("bad_xml.inkml" in m for _, m in errors) and any("bad_truth.inkml" in m for _, m in errors)
    assert sum("bad_xml.inkml" in r.getMessage() for r in caplog.records) == 1
    assert all(s.image.shape[0] == 32 for s in samples)


def test_load_split_duplicate_ids(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write(tmp_path / "a" / "same.inkml")
    write(tmp_path / "b" / "same.inkml")
    samples, errors, _ = load_crohme_split(tmp_path, Raster(32, 1), "skip")
    assert len(samples) == 1 and errors[0][0] == "duplicate id" and "same" in errors[0][1]


def test_load_split_missing_or_empty_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist.*data.root"):
        load_crohme_split(tmp_path / "valid", Raster(32, 1), "skip")
    (tmp_path / "valid").mkdir()
    (tmp_path / "valid" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match="has no .inkml files.*data.root") as e:
        load_crohme_split(tmp_path / "valid", Raster(32, 1), "skip")
    assert "valid" in str(e.value)
    with pytest.raises(ValueError, match="on_error"):
        load_crohme_split(tmp_path / "valid", Raster(32, 1), "warn")


# ---------------------------------------------------------------------------------------------------------------
# the CROHME 2014 dictionary, the published layout, the held-out validation split, the cache


def test_crohme_dictionary_is_wap_s_110_symbols():
    assert len(CROHME_2014_SYMBOLS) == 110
    vocab = crohme_vocab()
    assert vocab.tokens[0] == "<eol>" and len(vocab) == 111
    for token in ("\\sin", "\\lim", "\\ldots", "\\prime", "\\{", "\\}", "<", ">", "\\rightarrow", "!"):
        assert token in vocab.index


# One file per quirk seen across the six training sources and the two test sets.
NS = 'xmlns="http://www.w3.org/2003/InkML"'
QUIRKS = {
    # name: (truth annotation, traces, the namespace attribute)
    "ns_dollar_2d": (r"$x^2$", TRACES, NS),  # namespace, $-wrapped, x y points
    "nons_plain_3d": (
        r"\frac{a}{b}",
        '<trace id="0">0 0 1, 10 0 2</trace><trace id="1">0 5 3, 5 9 4</trace>',
        "",
    ),
    "lt_alias": (r"$a \lt b$", TRACES, NS),
    "sin_cdots": (r"$\sin x + \cdots$", TRACES, NS),
}


def quirk_file(path, truth, traces, ns):
    text = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<ink {ns}><annotation type="truth">{truth}</annotation>{traces}'
        '<traceGroup><annotation type="truth">Segmentation</annotation></traceGroup></ink>'
    )
    return write(path, text=text)


def published_layout(root, train_labels=("x^2", "a+b", "\\frac{1}{2}", "\\sqrt{x}", "x_1", "y-1") * 3):
    """A small CROHME_labeled_2016: TrainINKML/ with two sources (each label written in both), two test sets."""
    for source in ("HAMEX", "KAIST"):
        (root / "TrainINKML" / source).mkdir(parents=True)
        for i, label in enumerate(train_labels):
            write(root / "TrainINKML" / source / f"{source}_{i}.inkml", truth=f"${label}$")
    for name, folder in (("2014", "TestEM2014GT"), ("2016", "TEST2016_INKML_GT")):
        (root / folder).mkdir(parents=True)
        for key, (truth, traces, ns) in QUIRKS.items():
            quirk_file(root / folder / f"{name}_{key}.inkml", truth, traces, ns)
    return root


def crohme_cfg(root, cache, **over):
    from conftest import compose_config
    from omegaconf import OmegaConf

    cfg = compose_config(["data=crohme", f"data.root={root}", f"data.cache_dir={cache}"]).data
    for k, v in over.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def test_quirks_of_each_source_read(tmp_path):
    for key, (truth, traces, ns) in QUIRKS.items():
        s = read_inkml(quirk_file(tmp_path / f"{key}.inkml", truth, traces, ns), Raster(32, 1))
        assert s.image.any() and s.tokens
    assert read_inkml(tmp_path / "lt_alias.inkml", Raster(32, 1)).tokens == ["a", "<", "b"]
    assert read_inkml(tmp_path / "nons_plain_3d.inkml", Raster(32, 1)).tokens == "\\frac { a } { b }".split()
    outside = quirk_file(tmp_path / "outside.inkml", r"$\Omega + 1$", TRACES, NS)
    with pytest.raises(DataError, match="outside the CROHME 2014 dictionary.*Omega") as e:
        read_inkml(outside, Raster(32, 1))
    assert e.value.reason == "symbol outside the dictionary"


def test_published_layout_splits_and_report(tmp_path):
    from wapstable.data.batches import by_test_set, load_splits

    root = published_layout(tmp_path / "CROHME_labeled_2016")
    write(root / "TestEM2014GT" / "broken.inkml", text="<ink>")  # counted in 2014's total, as wrong
    write(root / "TrainINKML" / "KAIST" / "empty_trace.inkml", traces='<trace id="0"> </trace>')
    quirk_file(root / "TrainINKML" / "KAIST" / "omega.inkml", r"$\Omega$", TRACES, NS)
    cfg = crohme_cfg(root, tmp_path / "cache", valid_fraction=0.3)
    splits = load_splits(cfg)

    train = {" ".join(s.tokens) for s in splits["train"]}
    valid = {" ".join(s.tokens) for s in splits["valid"]}
    assert valid and train and not valid & train  # held out by expression: every copy of a label on one side
    assert len(splits["train"]) + len(splits["valid"]) == 2 * 18
    sets = by_test_set(splits["test"])
    assert sorted(sets) == ["2014", "2016"] and len(sets["2014"]) == len(sets["2016"]) == len(QUIRKS)
    assert splits.report["test_sets"] == {"2014": len(QUIRKS) + 1, "2016": len(QUIRKS)}
    assert splits.report["skipped"]["test 2014"] == {"malformed XML": 1}
    assert splits.report["skipped"]["train"] == {"no ink": 1, "symbol outside the dictionary": 1}

    # the split is a function of the labels alone: the same on a second reading, and stable as the fraction grows
    again = load_splits(crohme_cfg(root, tmp_path / "other_cache", valid_fraction=0.3))
    assert [s.id for s in again["valid"]] == [s.id for s in splits["valid"]]
    more = load_splits(crohme_cfg(root, tmp_path / "cache", valid_fraction=0.6))
    assert valid <= {" ".join(s.tokens) for s in more["valid"]}


def test_published_layout_errors(tmp_path):
    from wapstable.data.batches import load_splits

    root = published_layout(tmp_path / "c")
    write(root / "TrainINKML" / "HAMEX" / "broken.inkml", text="<ink>")
    with pytest.raises(DataError, match="broken.inkml.*data.on_error=skip"):
        load_splits(crohme_cfg(root, tmp_path / "cache", on_error="fail"))
    with pytest.raises(DataError, match="TestEM2099.*does not exist.*data.root"):
        load_splits(crohme_cfg(root, tmp_path / "cache", test_sets={"2099": "TestEM2099"}))
    with pytest.raises(UserError, match="valid_fraction"):
        load_splits(crohme_cfg(root, tmp_path / "cache", valid_fraction=1.5))
    with pytest.raises(UserError, match="data.valid is empty"):
        load_splits(crohme_cfg(root, tmp_path / "cache", valid_fraction=0.0))


def test_cache_is_used_and_keyed_by_files_and_settings(tmp_path, monkeypatch):
    import wapstable.data.sources.crohme as crohme

    root = published_layout(tmp_path / "c")
    cache = tmp_path / "cache"
    first = crohme.read_folder(root / "TrainINKML", Raster(40, 2), cache)
    calls = []
    real = crohme.read_inkml
    monkeypatch.setattr(crohme, "read_inkml", lambda *a: calls.append(a) or real(*a))
    cached = crohme.read_folder(root / "TrainINKML", Raster(40, 2), cache)
    assert calls == [] and [s.id for s in cached.samples] == [s.id for s in first.samples]
    assert all(
        (a.image == b.image).all() and a.tokens == b.tokens for a, b in zip(first.samples, cached.samples)
    )
    crohme.read_folder(root / "TrainINKML", Raster(40, 3), cache)  # another pen width: read again
    assert len(calls) == first.total
    write(root / "TrainINKML" / "HAMEX" / "new.inkml", truth="$z$")  # another file: read again
    assert (
        len(crohme.read_folder(root / "TrainINKML", Raster(40, 2), cache).samples) == len(first.samples) + 1
    )
    # a torn cache file is only a lost cache
    for f in cache.rglob("*.npz"):
        f.write_bytes(f.read_bytes()[:100])
    assert (
        len(crohme.read_folder(root / "TrainINKML", Raster(40, 2), cache).samples) == len(first.samples) + 1
    )


def test_symbol_scale_keeps_the_ink_s_scale():
    small = [np.array([[0, 0], [0, 10]]), np.array([[5, 0], [5, 10]])]  # two strokes 10 units long
    tall = [*small, np.array([[0, 30], [0, 40]]), np.array([[5, 30], [5, 40]])]  # the same, two lines of it
    a = rasterize_traces(small, height=200, line_width=1, margin=4, symbol_size=20)
    b = rasterize_traces(tall, height=200, line_width=1, margin=4, symbol_size=20)
    assert a.shape[0] == 20 + 8 + 1 and b.shape[0] == 80 + 8 + 1  # the symbol 20 px in both
    c = rasterize_traces(tall, height=40, line_width=1, margin=4, symbol_size=20)  # too tall: shrunk to fit
    assert c.shape[0] == 40
    fixed = rasterize_traces(small, height=64, line_width=1, margin=4)
    assert fixed.shape[0] == 64


def test_render_draws_inkml_as_training_does(tmp_path, capsys):
    from PIL import Image

    from wapstable.cli import render

    path = write(tmp_path / "expr.inkml", truth=r"$x^2$")
    render.main([str(path), str(tmp_path / "out.png"), "--symbol-size", "20", "--height", "100"])
    png = 255 - np.asarray(Image.open(tmp_path / "out.png"))  # dark ink on white, as a scan
    assert (png == read_inkml(path, Raster(100, 2, 20.0)).image).all()
    assert capsys.readouterr().out.split("\t")[1] == "x ^ { 2 }"


# ---------------------------------------------------------------------------------------------------------------
# data.redraw: more drawings of each training file, in other hands

# an "x" of two strokes (one traceGroup) and a "2" of one, as in TRACES; a long bar below them (a trace in no group)
GROUPED = """<trace id="0">10 10, 20 20, 30 30</trace><trace id="1">30 10, 10 30</trace>
  <trace id="2">40 5, 50 4, 55 10, 42 30, 56 30</trace><trace id="3">0 40, 60 40, 120 40</trace>
  <traceGroup><annotation type="truth">Segmentation</annotation>
    <traceGroup><annotation type="truth">x</annotation><traceView traceDataRef="0"/><traceView traceDataRef="1"/>
    </traceGroup>
    <traceGroup><annotation type="truth">2</annotation><traceView traceDataRef="2"/></traceGroup>
  </traceGroup>"""


def test_redraw_moves_each_symbol_as_one(tmp_path):
    import xml.etree.ElementTree as ET

    from wapstable.data.ink.inkml import symbol_groups
    from wapstable.data.ink.redraw import Redraw, redraw_traces

    path = write(tmp_path / "e.inkml", truth="$x^2$", traces=GROUPED)
    root = ET.parse(path).getroot()
    assert symbol_groups(root, ["0", "1", "2", "3"]) == [
        [0, 1],
        [2],
        [3],
    ]  # the bar, in no group, on its own
    traces = [parse_trace(t.text) for t in root.iter() if t.tag.endswith("trace")]

    def drawn(index, strength=1.0):
        return redraw_traces(traces, [[0, 1], [2], [3]], Redraw(index).rng("e"), strength)

    assert all((a == b).all() for a, b in zip(drawn(1, 0.0), traces))  # strength 0: as written
    one, again, two = drawn(1), drawn(1), drawn(2)
    assert all((a == b).all() for a, b in zip(one, again))  # the file's name and the index seed it
    assert not all(np.allclose(a, b) for a, b in zip(one, two))
    assert [len(t) for t in one] == [len(t) for t in traces]
    for t, r in zip(traces, one):  # moved, but by a fraction of the symbol size (about 20 units here)
        assert 0 < np.abs(t - r).max() < 20
    # the long bar bends no more than a symbol of the usual size would: it stays a bar
    assert np.ptp(one[3][:, 1]) < 0.3 * np.ptp(one[3][:, 0])
    # the two strokes of the x are moved together: where they cross stays near the crossing of the two new strokes
    crossing = (one[0][1] + (one[1][0] + one[1][1]) / 2) / 2  # the middles of the two new strokes
    assert np.linalg.norm(crossing - [20.0, 20.0]) < 6


def test_redraw_adds_drawings_of_training_files_only(tmp_path, monkeypatch):
    import wapstable.data.sources.crohme as crohme
    from wapstable.data.batches import load_splits

    root = published_layout(tmp_path / "c")
    plain = load_splits(crohme_cfg(root, tmp_path / "cache", valid_fraction=0.3))
    cfg = crohme_cfg(root, tmp_path / "cache", valid_fraction=0.3, redraw=2, render_workers=0)
    splits = load_splits(cfg)
    ids = [s.id for s in plain["train"]]
    assert [s.id for s in splits["train"]] == ids + [f"{i}~1" for i in ids] + [f"{i}~2" for i in ids]
    assert [s.id for s in splits["valid"]] == [s.id for s in plain["valid"]]  # the validation files: never
    assert [s.id for s in splits["test"]] == [s.id for s in plain["test"]]
    by_id = {s.id: s for s in splits["train"]}
    for i in ids:
        first, second = by_id[f"{i}~1"], by_id[f"{i}~2"]
        assert first.tokens == second.tokens == by_id[i].tokens
        assert first.image.shape != by_id[i].image.shape or (first.image != by_id[i].image).any()
        assert first.image.shape != second.image.shape or (first.image != second.image).any()

    # read once, then from the cache; the file's own drawing keeps its cache key
    calls = []
    real = crohme.read_inkml
    monkeypatch.setattr(crohme, "read_inkml", lambda *a: calls.append(a) or real(*a))
    again = load_splits(cfg)
    assert calls == [] and all((a.image == b.image).all() for a, b in zip(again["train"], splits["train"]))
    cfg.redraw_strength = 0.5  # another strength: every file of the folder drawn twice again
    load_splits(cfg)
    assert len(calls) == 2 * 36 and all(a[2].strength == 0.5 for a in calls)


def test_read_folder_in_worker_processes_reads_the_same(tmp_path):
    from wapstable.data.ink.redraw import Redraw
    from wapstable.data.sources.crohme import read_folder

    root = published_layout(tmp_path / "c")
    write(root / "TrainINKML" / "HAMEX" / "broken.inkml", text="<ink>")
    for redraw in (None, Redraw(1)):
        one = read_folder(root / "TrainINKML", Raster(40, 2), redraw=redraw)
        two = read_folder(root / "TrainINKML", Raster(40, 2), redraw=redraw, workers=2)
        assert [s.id for s in one.samples] == [s.id for s in two.samples] and one.errors == two.errors
        assert all((a.image == b.image).all() for a, b in zip(one.samples, two.samples))
        assert one.reasons() == {"malformed XML": 1}


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_redraw_trains_end_to_end(tmp_path):
    from conftest import run_train

    root = published_layout(tmp_path / "c")
    args = ["data=crohme", f"data.root={root}", "data.valid_fraction=0.3", "data.height=32"]
    plain = run_train(args, tmp_path / "plain", tmp_path / "cache").stdout
    log = run_train([*args, "data.redraw=1"], tmp_path / "run", tmp_path / "cache").stdout
    n = int(plain.split("data: crohme, ")[1].split(" train")[0])
    assert f"data.redraw=1: {n} more drawings of the {n} training files" in log
    assert f"data: crohme, {2 * n} train" in log and (tmp_path / "run" / "metrics.json").is_file()


@pytest.mark.parametrize(
    "bad, says",
    [
        (["data.redraw=-1"], "data.redraw=-1 and data.redraw_strength=1.0 must be >= 0"),
        (["data.redraw=1", "data.redraw_strength=-0.5"], "data.redraw_strength=-0.5 must be >= 0"),
    ],
)
def test_bad_redraw_values_are_refused(tmp_path, bad, says):
    from conftest import run_train

    root = published_layout(tmp_path / "c")
    proc = run_train(
        ["data=crohme", f"data.root={root}", *bad], tmp_path / "run", tmp_path / "cache", check=False
    )
    assert proc.returncode == 2 and says in proc.stderr + proc.stdout, proc.stderr[-500:]
    assert not (tmp_path / "cache" / "crohme").exists()  # refused before anything was read
