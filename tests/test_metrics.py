import pytest

from wapstable.eval.metrics import ExpressionMetrics, edit_distance, format_table, length_bucket


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
