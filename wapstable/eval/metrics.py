"""Expression-level metrics as reported for CROHME: ExpRate, within-k edits, token error rate, by length."""

from collections import Counter
from collections.abc import Iterable, Sequence

# Reference-length buckets (inclusive bounds; None = open); empty references count in the first bucket.
LENGTH_BUCKETS: list[tuple[int, int | None]] = [(1, 5), (6, 10), (11, 20), (21, 40), (41, None)]


def _bucket_name(lo: int, hi: int | None) -> str:
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def length_bucket(n: int) -> str:
    """The name of the reference-length bucket that a label of `n` tokens falls in, e.g. "6-10"."""
    for lo, hi in LENGTH_BUCKETS:
        if hi is None or n <= hi:
            return _bucket_name(lo, hi)
    raise AssertionError("the last bucket is open")


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance between two token sequences (unit cost insert, delete, substitute)."""
    if len(a) < len(b):
        a, b = b, a  # keep the row as short as possible
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


NONE = "<none>"  # a missing token in format_confusions ("-" is CROHME's minus)


def align(ref: Sequence[str], pred: Sequence[str]) -> list[tuple[str | None, str | None]]:
    """A least-edit alignment of a reference with a prediction, as (ref token, predicted token) pairs: equal or
    substituted tokens pair up, a deleted reference token pairs with None, an inserted predicted one follows None.
    The pairs that are not equal number edit_distance(ref, pred)."""
    n, m = len(ref), len(pred)
    d = [[i + j if i == 0 or j == 0 else 0 for j in range(m + 1)] for i in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (ref[i - 1] != pred[j - 1]))
    pairs: list[tuple[str | None, str | None]] = []
    i, j = n, m
    while i or j:
        if i and j and d[i][j] == d[i - 1][j - 1] + (ref[i - 1] != pred[j - 1]):
            pairs.append((ref[i - 1], pred[j - 1]))
            i, j = i - 1, j - 1
        elif i and d[i][j] == d[i - 1][j] + 1:
            pairs.append((ref[i - 1], None))
            i -= 1
        else:
            pairs.append((None, pred[j - 1]))
            j -= 1
    return pairs[::-1]


def confusions(pairs: Iterable[tuple[Sequence[str], Sequence[str]]]) -> Counter:
    """How often each edit occurs over (reference, prediction) pairs: Counter of (ref token, predicted token), None
    standing for a missing token (a deletion has None predicted, an insertion None in the reference)."""
    counts: Counter = Counter()
    for ref, pred in pairs:
        counts.update((r, p) for r, p in align(ref, pred) if r != p)
    return counts


def format_confusions(counts: Counter, top: int = 15) -> str:
    """The `top` most frequent edits as lines `count  ref -> predicted` (a missing token written as <none>)."""
    lines = [f"{'edits':>6}  reference -> predicted"]
    for (r, p), k in counts.most_common(top):
        lines.append(f"{k:>6}  {r or NONE} -> {p or NONE}")
    return "\n".join(lines)


class ExpressionMetrics:
    """Accumulates predicted vs reference token lists; compute() gives percentages over everything seen."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.exact = 0
        self.within = {1: 0, 2: 0, 3: 0}
        self.edits = 0
        self.ref_tokens = 0
        self.buckets: dict[str, list[int]] = {}  # name -> [count, exact]

    def update(self, preds: list[list[str]], refs: list[list[str]]) -> list[int]:
        """Add a batch of predictions and their references (same order, same length); their edit distances."""
        if len(preds) != len(refs):
            raise ValueError(f"got {len(preds)} predictions for {len(refs)} references")
        distances = [edit_distance(pred, ref) for pred, ref in zip(preds, refs)]
        for ref, d in zip(refs, distances):
            self.count += 1
            self.exact += d == 0
            for k in self.within:
                self.within[k] += d <= k
            self.edits += d
            self.ref_tokens += len(ref)
            b = self.buckets.setdefault(length_bucket(len(ref)), [0, 0])
            b[0] += 1
            b[1] += d == 0
        return distances

    def compute(self) -> dict:
        """Percentages (0-100) over all updates; `by_length` lists only buckets that received samples."""
        n = max(self.count, 1)  # no samples -> zeros, not a division error
        order = [_bucket_name(lo, hi) for lo, hi in LENGTH_BUCKETS]
        return {
            "count": self.count,
            "exprate": 100.0 * self.exact / n,
            **{f"within_{k}": 100.0 * v / n for k, v in self.within.items()},
            # total edits over total reference tokens, so long expressions weigh more (as WAP's compute-wer)
            "wer": 100.0 * self.edits / max(self.ref_tokens, 1),
            "ref_tokens": self.ref_tokens,
            "by_length": {
                name: {
                    "count": self.buckets[name][0],
                    "exprate": 100.0 * self.buckets[name][1] / self.buckets[name][0],
                }
                for name in order
                if name in self.buckets
            },
        }


def format_sets_table(sets: dict) -> str:
    """One row per scored test set (eval.evaluation.score_test_sets): the CROHME table of the papers."""
    head = f"{'test set':<10} {'total':>6} {'read':>6} {'ExpRate':>8} {'<=1':>7} {'<=2':>7} {'<=3':>7} {'WER':>7}"
    lines = [head, "-" * len(head)]
    for name, r in sets.items():
        lines.append(
            f"{name:<10} {r['total']:>6d} {r['read']:>6d} {r['exprate']:>8.2f} {r['within_1']:>7.2f} "
            f"{r['within_2']:>7.2f} {r['within_3']:>7.2f} {r['wer']:>7.2f}"
        )
    return "\n".join(lines)


def format_table(results: dict) -> str:
    """A plain-text table of a compute() result: the overall metrics, then ExpRate per reference length."""
    lines = [f"{'metric':<10} {'value':>8}"]
    lines.append("-" * len(lines[0]))
    lines.append(f"{'count':<10} {results['count']:>8d}")
    for key in ("exprate", "within_1", "within_2", "within_3", "wer"):
        if key in results:
            lines.append(f"{key:<10} {results[key]:>8.2f}")
    by_length = results.get("by_length") or {}
    if by_length:
        lines.append("")
        head = f"{'length':<10} {'count':>8} {'exprate':>8}"
        lines += [head, "-" * len(head)]
        for name, row in by_length.items():
            lines.append(f"{name:<10} {row['count']:>8d} {row['exprate']:>8.2f}")
    return "\n".join(lines)
