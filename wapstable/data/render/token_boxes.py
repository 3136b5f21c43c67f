"""Which token made each glyph and rule of mathtext's layout (glyph_hook's record), and the box of every token's
ink: mathtext creates the nodes it draws in an order that follows the tokens, so the two lists are matched one to
one, and a label whose layout does not match (a count or a symbol differs) gets no boxes rather than wrong ones.
"""

import math

import numpy as np

from wapstable.data.latex import INKLESS
from wapstable.data.sample import no_boxes

MULTI_GLYPH = frozenset({"\\sin", "\\cos", "\\tan", "\\log", "\\lim"})  # drawn as their letters


def _creation_order(tokens: list[str]) -> list[tuple[int, str, str]] | None:
    """(token index, "g" glyph or "r" rule, the glyph's character or "") in the order mathtext creates the nodes it
    draws: a symbol where it stands (a function name as its letters), a fraction's bar after its denominator, a
    root's sign and bar after its radicand (its index, `\\sqrt [ 3 ]`, before). None for an unbalanced label."""
    order: list[tuple[int, str, str]] = []
    groups: list[
        tuple[int | None, int]
    ] = []  # open { ... }: (the structure it belongs to, its groups after it)
    pending: tuple[int, int] | None = None  # a structure waiting for its next group: (index, groups left)
    index = False  # inside a root's [ index ]
    for i, tok in enumerate(tokens):
        if (
            tok == "["
            and pending is not None
            and tokens[pending[0]] == "\\sqrt"
            and tokens[i - 1] == "\\sqrt"
        ):
            index = True
        elif tok == "]" and index:
            index = False
        elif tok == "{":
            if pending is not None:
                groups.append((pending[0], pending[1] - 1))
                pending = None
            else:
                groups.append((None, 0))
        elif tok == "}":
            if not groups:
                return None
            owner, after = groups.pop()
            if owner is not None and after:
                pending = (owner, after)
            elif owner is not None:
                order += (
                    [(owner, "g", ""), (owner, "r", "")] if tokens[owner] == "\\sqrt" else [(owner, "r", "")]
                )
        elif tok == "\\frac":
            pending = (i, 2)
        elif tok == "\\sqrt":
            pending = (i, 1)
        elif tok in MULTI_GLYPH:
            order += [(i, "g", c) for c in tok[1:]]
        elif tok not in INKLESS:
            order.append((i, "g", tok))
    return order if not groups and pending is None and not index else None


def is_glyph_of(token: str, c: str) -> bool:
    """Whether mathtext's glyph `c` (a character, or a name like "\\prime") is how it draws `token`: the token itself,
    its command without the backslash, the minus sign for "-", the prime for "'"."""
    return (
        c == token
        or c == token.lstrip("\\")
        or token == "-"
        and c == "\N{MINUS SIGN}"
        or token == "'"
        and c == "\\prime"
    )


def match_layout(tokens: list[str], items: list) -> list[tuple[int, str, tuple, str]] | None:
    """The recorded glyphs and rules (items) each with the index of the token that made it: (token index, kind,
    box, character); None when the layout does not match the tokens one to one (a count or a symbol differs)."""
    order = _creation_order(tokens)
    nodes = sorted(items, key=lambda item: item[0])
    if order is None or [kind for _, kind, _ in order] != [item[1] for item in nodes]:
        return None
    out = []
    for (i, kind, want), (_, _, box, c) in zip(order, nodes):
        if kind == "g" and tokens[i] != "\\sqrt" and not is_glyph_of(want, c):
            return None
        out.append((i, kind, box, c))
    return out


def _ink_box(box, img: np.ndarray) -> tuple[float, float, float, float]:
    """The box of the ink within `box` grown by 1 px (the font's metrics are not the pixels it draws)."""
    h, w = img.shape
    x0, y0 = max(0, math.floor(box[0]) - 1), max(0, math.floor(box[1]) - 1)
    x1, y1 = min(w, math.ceil(box[2]) + 1), min(h, math.ceil(box[3]) + 1)
    sub = img[y0:y1, x0:x1]
    rows, cols = np.flatnonzero(sub.any(1)), np.flatnonzero(sub.any(0))
    if not rows.size:
        return (x0, y0, max(x1, x0 + 1), max(y1, y0 + 1))
    return (x0 + cols[0], y0 + rows[0], x0 + cols[-1] + 1, y0 + rows[-1] + 1)


def token_boxes(tokens: list[str], items: list, img: np.ndarray) -> np.ndarray | None:
    """(len(tokens), 4) boxes x0, y0, x1, y1 in `img`'s pixels, NaN for a token without ink; None when the layout
    does not match the tokens one to one (a count or a symbol differs)."""
    matched = match_layout(tokens, items)
    if matched is None:
        return None
    boxes = no_boxes(len(tokens))
    for i, kind, box, _ in matched:
        if tokens[i] == "\\sqrt" and kind == "r":
            continue  # the sign marks the root; its bar spans the radicand, whose own tokens are there
        grow_box(boxes, i, _ink_box(box, img))  # a function name's letters make one box
    return boxes


def grow_box(boxes: np.ndarray, i: int, box) -> None:
    """Row `i` of `boxes` widened to enclose `box` (x0, y0, x1, y1); a NaN row becomes `box`."""
    boxes[i, :2] = np.fmin(boxes[i, :2], box[:2])
    boxes[i, 2:] = np.fmax(boxes[i, 2:], box[2:])
