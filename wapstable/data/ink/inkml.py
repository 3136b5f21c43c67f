"""CROHME InkML read as it is: the namespace-free tag names, the points of a trace, the traces of each written
symbol (its traceGroup), and the expression's truth normalised and checked against the CROHME 2014 dictionary."""

from pathlib import Path

import numpy as np

from wapstable.data.latex import CROHME_2014_SYMBOLS, DataError, normalize_crohme, tokenize_latex


def local_tag(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # drop "{http://www.w3.org/2003/InkML}"; some files have no namespace


def parse_trace(text: str) -> np.ndarray:
    """Points of one `<trace>` body ("x y, x y" or "x y t, ...") as an (N, 2) float array of x, y."""
    points = []
    for chunk in text.split(","):
        values = chunk.split()
        if not values:
            continue  # a trailing comma
        if len(values) < 2:
            raise ValueError(f"a point needs x and y, got {chunk.strip()!r}")
        points.append((float(values[0]), float(values[1])))
    return np.asarray(points, dtype=np.float64).reshape(-1, 2)


def symbol_groups(root, ids: list) -> list[list[int]]:
    """The traces (indices into `ids`, the traces' ids in document order) of each written symbol: the traceGroups
    that name traces, and each trace in no such group on its own."""
    where = {t: i for i, t in enumerate(ids) if t is not None}
    groups, grouped = [], set()
    for tg in root.iter():
        if local_tag(tg.tag) != "traceGroup":
            continue
        refs = [c.get("traceDataRef") for c in tg if local_tag(c.tag) == "traceView"]
        members = [where[r] for r in dict.fromkeys(refs) if r in where and where[r] not in grouped]
        if members:
            groups.append(members)
            grouped.update(members)
    return groups + [[i] for i in range(len(ids)) if i not in grouped]


def read_truth(path: Path, root) -> list[str]:
    """The expression's normalised truth tokens, checked against the CROHME 2014 dictionary."""
    # Only the expression's own truth: traceGroups carry per-symbol truth annotations too.
    truth = next(
        (a.text for a in root if local_tag(a.tag) == "annotation" and a.get("type") == "truth"),
        None,
    )
    if truth is None or not truth.strip().strip("$").strip():
        raise DataError(f'{path}: no <annotation type="truth"> with the expression\'s LaTeX', "no truth")
    try:
        tokens = normalize_crohme(tokenize_latex(truth))
    except DataError as e:
        raise DataError(f"{path}: truth '{truth.strip()}' does not parse: {e}", e.reason) from None
    if not tokens:
        raise DataError(f"{path}: truth '{truth.strip()}' has no tokens after normalisation", "no truth")
    outside = sorted(set(tokens) - DICTIONARY)
    if outside:
        raise DataError(
            f"{path}: truth '{truth.strip()}' has symbols outside the CROHME 2014 dictionary: {' '.join(outside)}",
            "symbol outside the dictionary",
        )
    return tokens


DICTIONARY = frozenset(CROHME_2014_SYMBOLS)
