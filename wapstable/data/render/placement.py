"""Where writers put what mathtext sets: scripts moved to the places CROHME writers put them (data.script_place)
and symbols set apart as they space them (data.spacing). Each works on the drawn strokes, each stroke with the index
of the token that made it, so the boxes move with the ink.
"""

import numpy as np

SCRIPT_MOVES = {"_": (0.75, 0.14, 0.19), "^": (1.0, -0.14, 0.0)}  # (scale, shift down, shift right)
# bases whose scripts mathtext puts under and over them: left alone
LIMITS_BELOW = {"\\sum", "\\prod", "\\lim"}


def closing_brace(tokens: list[str], i: int) -> int:
    """The index of the "}" that closes the "{" at `i`."""
    depth = 0
    for j in range(i, len(tokens)):
        depth += (tokens[j] == "{") - (tokens[j] == "}")
        if depth == 0:
            return j
    return len(tokens) - 1


def script_groups(tokens: list[str]) -> list[tuple[str, int, int, int, int]]:
    """(script, base index, first and last token index of its argument, end of the enclosing group) of every `_ {`
    and `^ {` whose base is one drawn token (the script after a subscript shares its base), in token order."""
    enclosing = [len(tokens)]  # the index of the "}" closing each open group, outermost first
    groups, base_of_close = [], {}
    for i, t in enumerate(tokens):
        while enclosing[-1] < i:
            enclosing.pop()
        if t == "{":
            enclosing.append(closing_brace(tokens, i))
        if t not in SCRIPT_MOVES or i + 1 >= len(tokens) or tokens[i + 1] != "{" or i == 0:
            continue
        base = base_of_close.get(i - 1, i - 1) if tokens[i - 1] == "}" else i - 1
        if (
            tokens[base] in ("}", "{", "]", "[")
            or tokens[base] in LIMITS_BELOW
            or tokens[base] in SCRIPT_MOVES
        ):
            continue
        end = closing_brace(tokens, i + 1)
        base_of_close[end] = base
        groups.append((t, base, i + 2, end - 1, enclosing[-1]))
    return groups


def _ink_extent(strokes: list[np.ndarray]) -> np.ndarray:
    pts = np.concatenate(strokes)
    return np.concatenate([pts.min(0), pts.max(0)])  # x0, y0, x1, y1


def place_scripts(
    tokens: list[str], drawn: list, rng: np.random.Generator, chance: float, jitter: float
) -> list:
    """`drawn` ((token index, stroke) pairs on mathtext's layout) with each script moved, with probability
    `chance`, to where writers put it (SCRIPT_MOVES, varied by `jitter`): scaled about its centre, moved down or up
    and right by shares of its base's height; what follows it in the same group moves with its right edge."""
    drawn = list(drawn)
    for script, base, first, last, group_end in script_groups(tokens):
        if not rng.random() < chance:
            continue
        own = [k for k, (o, _) in enumerate(drawn) if o is not None and first <= o <= last]
        base_ink = [s for o, s in drawn if o == base]
        if not own or not base_ink:
            continue
        _, by0, _, by1 = _ink_extent(base_ink)
        x0, y0, x1, y1 = _ink_extent([drawn[k][1] for k in own])
        h = by1 - by0
        if h <= 0:
            continue
        scale, down, right = SCRIPT_MOVES[script]
        scale *= float(np.exp(rng.normal(0, 0.12 * jitter)))
        centre = np.array([(x0 + x1) / 2, (y0 + y1) / 2])
        # the left edge moves `right` base heights; the centre `down` base heights
        dx = right * h + float(rng.normal(0, 0.06 * jitter)) * h - (1 - scale) * (x1 - x0) / 2
        dy = down * h + float(rng.normal(0, 0.06 * jitter)) * h
        for k in own:
            o, s = drawn[k]
            drawn[k] = (o, (s - centre) * scale + centre + (dx, dy))
        moved = (x1 - centre[0]) * scale + centre[0] + dx - x1
        for k, (o, s) in enumerate(drawn):
            if o is not None and last < o < group_end:
                drawn[k] = (o, s + (moved, 0.0))
    return drawn


# How far apart writers set things, against mathtext's layout of the same labels drawn as rendered handwriting, on
# the symbol boxes of 500 CROHME training files (every 15th of the sorted files; scripts/layout_stats.py measures
# the same on any files), in letter heights (the median height of an expression's letters and digits;
# docs/studies/handwriting.md, "Symbols set apart and fonts mixed"):
# - two neighbouring symbols: a median gap of 0.30 in the ink against 0.11 rendered (10th to 90th percentile
#   -0.01..0.91 against -0.29..0.54), so a writer adds about 0.2;
# - a fraction's numerator sits 0.18 above its bar and the denominator 0.18 below (rendered: -0.09 and -0.07,
#   touching it), and the bar reaches 0.31 left and 0.19 right beyond them (rendered: -0.07 and -0.09).
SYMBOL_GAP = 0.2
# numerator up, denominator down, the bar longer on the left and on the right: the differences above, less what the
# gaps between symbols add to the bar's right end after it (fitted on the same 500 files)
FRACTION_GAPS = (0.31, 0.26, 0.38, 0.22)
# drawn across what they cover: stretched with the gaps, not moved
STRETCHED = frozenset({"\\frac", "\\sqrt"})


def _owners(drawn: list) -> dict[int, list[int]]:
    owners: dict[int, list[int]] = {}
    for k, (o, _) in enumerate(drawn):
        if o is not None:
            owners.setdefault(o, []).append(k)
    return owners


def _shift_x(tokens, drawn, owners, shift) -> list:
    """Every stroke moved right by `shift(x)`: a symbol as one piece, by the shift at its centre; a fraction bar or
    a radical point by point, so that it stretches over what it covers."""
    out = list(drawn)
    for o, ks in owners.items():
        if tokens[o] in STRETCHED:
            for k in ks:
                st = out[k][1]
                out[k] = (o, np.stack([st[:, 0] + shift(st[:, 0]), st[:, 1]], 1))
        else:
            x0, _, x1, _ = _ink_extent([out[k][1] for k in ks])
            dx = float(shift(np.array((x0 + x1) / 2)))
            for k in ks:
                out[k] = (o, out[k][1] + (dx, 0.0))
    return out


def _open_fractions(tokens, drawn, rng, amount, jitter, h) -> list:
    """Each fraction's numerator moved up from its bar and its denominator down, and its bar made longer on both
    sides with what follows it moved right (FRACTION_GAPS, times `amount`, varied by `jitter`), outer first."""
    for i, t in enumerate(tokens):
        if t != "\\frac" or i + 1 >= len(tokens) or tokens[i + 1] != "{":
            continue
        owners = _owners(drawn)
        if i not in owners:
            continue
        end_num = closing_brace(tokens, i + 1)
        end_den = closing_brace(tokens, end_num + 1) if end_num + 1 < len(tokens) else end_num
        up, down, left, right = (
            amount * h * max(0.0, g + float(rng.normal(0, 0.1 * jitter))) for g in FRACTION_GAPS
        )
        out = list(drawn)
        for o, ks in owners.items():
            dy = -up if i + 1 < o < end_num else down if end_num + 1 < o < end_den else 0.0
            for k in ks if dy else ():
                out[k] = (o, out[k][1] + (0.0, dy))
        bx0, _, bx1, _ = _ink_extent([out[k][1] for k in owners[i]])
        for k in owners[i]:  # the bar from bx0..bx1 to bx0..bx1 + left + right
            st = out[k][1]
            x = bx0 + (st[:, 0] - bx0) * (bx1 - bx0 + left + right) / max(bx1 - bx0, 1e-6)
            out[k] = (i, np.stack([x, st[:, 1]], 1))

        # what lies right of each end of the bar moves right by that end's lengthening; the bar is left as drawn
        def widen(x, x0=bx0, x1=bx1, more=(left, right)):
            return more[0] * (x > x0) + more[1] * (x > x1)

        drawn = _shift_x(tokens, out, {o: ks for o, ks in owners.items() if o != i}, widen)
    return drawn


def _limits(tokens: list[str]) -> set[int]:
    """The indices of the tokens mathtext sets under or over a \\sum, \\prod or \\lim (its limits)."""
    out: set[int] = set()
    for i, t in enumerate(tokens):
        if t not in LIMITS_BELOW:
            continue
        j = i + 1 + (i + 1 < len(tokens) and tokens[i + 1] == "\\limits")
        while j + 1 < len(tokens) and tokens[j] in SCRIPT_MOVES and tokens[j + 1] == "{":
            end = closing_brace(tokens, j + 1)
            out.update(range(j + 2, end))
            j = end + 1
    return out


def spread_symbols(
    tokens: list[str], drawn: list, rng: np.random.Generator, amount: float, jitter: float
) -> list:
    """`drawn` ((token index, stroke) pairs) set apart as writers set symbols, `amount` times the gaps they add
    (1: as measured), each varied by `jitter`: every fraction opened (its numerator and denominator moved off its
    bar, the bar made longer), then a gap of SYMBOL_GAP letter heights on average, varied per expression and per gap,
    added after every drawn symbol but the limits of a sum. A symbol moves by the gaps of the symbols that end left of
    it; fraction bars and radicals stretch under what they cover; inkless strokes (owner None) are left alone."""
    owners = _owners(drawn)
    extent = {o: _ink_extent([drawn[k][1] for k in ks]) for o, ks in owners.items()}
    rigid = [o for o in owners if tokens[o] not in STRETCHED]
    letters = [o for o in rigid if len(tokens[o]) == 1 and tokens[o].isalnum()] or rigid
    if not letters:
        return list(drawn)
    h = float(np.median([extent[o][3] - extent[o][1] for o in letters]))
    if not h > 0:
        return list(drawn)
    drawn = _open_fractions(tokens, drawn, rng, amount, jitter, h)
    if len(rigid) < 2:
        return drawn
    extent = {o: _ink_extent([drawn[k][1] for k in ks]) for o, ks in owners.items()}
    mean = amount * SYMBOL_GAP * float(np.exp(rng.normal(0, 0.3 * jitter)))
    # the limits under and over a sum move with it: their gaps would push the sum off them
    below = _limits(tokens)
    rights = np.sort([extent[o][2] for o in rigid if o not in below])
    gaps = h * np.maximum(0.0, mean + amount * rng.normal(0, 0.1 * jitter, len(rights)))
    ramp = 0.3 * h  # the gap opens over this width: a bar's points move smoothly

    def shift(x: np.ndarray) -> np.ndarray:
        return (gaps * np.clip((x[..., None] - rights) / ramp, 0.0, 1.0)).sum(-1)

    return _shift_x(tokens, drawn, owners, shift)
