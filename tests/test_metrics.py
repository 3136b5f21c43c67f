import random
from collections import Counter

import pytest

from wapstable.eval.metrics import (
    ExpressionMetrics,
    align,
    confusions,
    edit_distance,
    format_confusions,
    format_table,
    length_bucket,
)


def test_edit_distance_known_values():
    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance([], []) == 0
    assert edit_distance([], ["a", "b"]) == 2
    assert edit_distance(["a", "b"], []) == 2
    assert edit_distance(["\\frac", "{", "1", "}"], ["\\frac", "{", "1", "}"]) == 0
    # tokens, not characters: one substituted multi-character token is one edit
    assert edit_distance(["\\alpha", "+", "b"], ["\\beta", "+", "b"]) == 1
    a, b = "x ^ { 2 } + 1".split(), "x _ { 2 } 1".split()
    assert edit_distance(a, b) == edit_distance(b, a) == 2


def test_align_pairs_the_edits_of_the_least_edit_path():
    assert align("x ^ { 2 }".split(), "x { 2 }".split()) == [
        ("x", "x"),
        ("^", None),
        ("{", "{"),
        ("2", "2"),
        ("}", "}"),
    ]
    assert align(["a", "+", "b"], ["a", "t", "b", "c"]) == [("a", "a"), ("+", "t"), ("b", "b"), (None, "c")]
    assert align([], ["a"]) == [(None, "a")] and align(["a"], []) == [("a", None)] and align([], []) == []
    rng = random.Random(0)
    for _ in range(500):  # any pair: both sequences read back, and the unequal pairs are the edit distance
        ref = [rng.choice("abxy") for _ in range(rng.randint(0, 8))]
        pred = [rng.choice("abxy") for _ in range(rng.randint(0, 8))]
        pairs = align(ref, pred)
        assert [r for r, _ in pairs if r is not None] == ref
        assert [p for _, p in pairs if p is not None] == pred
        assert sum(r != p for r, p in pairs) == edit_distance(ref, pred)


def test_confusions_count_each_edit_over_all_pairs():
    pairs = [
        ("a + b".split(), "a t b".split()),
        ("1 + 2".split(), "1 t 2 3".split()),
        ("x".split(), "x".split()),
    ]
    counts = confusions(pairs + [("a - b".split(), "a b".split())])
    assert counts.pop(("-", None)) == 1  # the minus dropped, printed apart from a missing token
    assert "1  - -> <none>" in format_confusions(Counter({("-", None): 1}))
    assert counts == {("+", "t"): 2, (None, "3"): 1}
    text = format_confusions(counts)
    assert text.splitlines()[1].split() == ["2", "+", "->", "t"]
    assert text.splitlines()[2].split() == ["1", "<none>", "->", "3"]


# distances 0, 1, 2, 5 against references of 3, 5, 6 and 12 tokens
REFS = [
    "a + b".split(),
    "x ^ { 2 }".split(),
    "a b c d e f".split(),
    "1 2 3 4 5 6 7 8 9 0 1 2".split(),
]
PREDS = [
    "a + b".split(),
    "x ^ { 3 }".split(),
    "a b c d".split(),
    "x y z 4 5 6 7 8 9 0".split(),
]


def test_hand_made_case():
    assert [edit_distance(p, r) for p, r in zip(PREDS, REFS)] == [0, 1, 2, 5]
    m = ExpressionMetrics()
    m.update(PREDS, REFS)
    r = m.compute()
    assert r["count"] == 4
    assert r["exprate"] == pytest.approx(25.0)
    assert r["within_1"] == pytest.approx(50.0)
    assert r["within_2"] == pytest.approx(75.0)
    assert r["within_3"] == pytest.approx(75.0)
    assert r["wer"] == pytest.approx(100.0 * 8 / 26)  # 0+1+2+5 edits over 3+5+6+12 reference tokens
    assert r["by_length"] == {
        "1-5": {"count": 2, "exprate": pytest.approx(50.0)},
        "6-10": {"count": 1, "exprate": 0.0},
        "11-20": {"count": 1, "exprate": 0.0},
    }
    assert list(r["by_length"]) == ["1-5", "6-10", "11-20"]  # in length order


def test_accumulates_over_batches_and_resets():
    one = ExpressionMetrics()
    one.update(PREDS, REFS)
    two = ExpressionMetrics()
    two.update(PREDS[:1], REFS[:1])
    two.update(PREDS[1:], REFS[1:])
    assert two.compute() == one.compute()
    two.update([["z"]], [["z"]])
    assert two.compute()["count"] == 5
    assert two.compute()["exprate"] == pytest.approx(40.0)
    two.reset()
    assert two.compute()["count"] == 0


def test_empty_and_mismatched():
    r = ExpressionMetrics().compute()
    assert r["count"] == 0 and r["exprate"] == 0.0 and r["wer"] == 0.0 and r["by_length"] == {}
    with pytest.raises(ValueError, match="2 predictions for 1"):
        ExpressionMetrics().update([["a"], ["b"]], [["a"]])


def test_length_buckets():
    assert [length_bucket(n) for n in (0, 1, 5, 6, 10, 11, 20, 21, 40, 41, 500)] == [
        "1-5",
        "1-5",
        "1-5",
        "6-10",
        "6-10",
        "11-20",
        "11-20",
        "21-40",
        "21-40",
        "41+",
        "41+",
    ]


def test_format_table():
    m = ExpressionMetrics()
    m.update(PREDS, REFS)
    text = format_table(m.compute())
    assert "exprate" in text and "25.00" in text
    assert "wer" in text and "30.77" in text
    assert "11-20" in text and "50.00" in text
    lines = text.splitlines()
    assert any(line.split() == ["count", "4"] for line in lines)


def test_test_sets_scored_over_all_of_their_expressions():
    """A test set's ExpRate is over its published size: an expression that could not be read counts as wrong."""
    import numpy as np

    from wapstable.data.sample import Sample
    from wapstable.eval.evaluation import combine_sets, score_test_sets
    from wapstable.eval.metrics import format_sets_table

    img = np.zeros((2, 2), np.uint8)
    refs = {
        "2014/a": "x + 1",
        "2014/b": "y",
        "2014/c": "a b c d",
        "2016/a": "x",
        "2016/b": "\\frac { 1 } { 2 }",
    }
    preds = {"2014/a": "x + 1", "2014/b": "y", "2014/c": "a b", "2016/a": "z", "2016/b": "\\frac { 1 } { 2 }"}
    samples = [Sample(k, img, v.split()) for k, v in refs.items()]

    def evaluate(group):
        m = ExpressionMetrics()
        m.update([preds[s.id].split() for s in group], [s.tokens for s in group])
        return m.compute()

    sets = score_test_sets(evaluate, samples, {"2014": 4, "2016": 2})  # 2014: one file was unreadable
    assert (sets["2014"]["total"], sets["2014"]["read"]) == (4, 3)
    assert sets["2014"]["exprate"] == pytest.approx(50.0)  # 2 of 4, not 2 of 3
    assert sets["2014"]["exprate_read"] == pytest.approx(200 / 3)
    assert sets["2014"]["within_2"] == pytest.approx(75.0)  # "a b" is 2 edits from "a b c d"
    assert sets["2014"]["within_1"] == pytest.approx(50.0)
    assert sets["2014"]["wer"] == pytest.approx(100 * 2 / 8)  # over the read ones' tokens
    assert sets["2016"]["exprate"] == pytest.approx(50.0) and sets["2016"]["wer"] == pytest.approx(
        100 * 1 / 8
    )
    both = combine_sets(sets)
    assert both["total"] == 6 and both["exprate"] == pytest.approx(50.0)
    assert both["wer"] == pytest.approx(100 * 3 / 16)
    rows = {line.split()[0]: line.split() for line in format_sets_table(sets).splitlines()[2:]}
    assert rows["2014"] == ["2014", "4", "3", "50.00", "50.00", "75.00", "75.00", "25.00"]
