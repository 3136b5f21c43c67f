"""The pen strokes of every glyph of data.style=handwritten, and the ways one hand differs from another.

Letters, digits and punctuation come from the Hershey stroke fonts (the `hershey-fonts` package: single-line
fonts, sans, roman, italic and script); Greek letters from its Greek set; the other math symbols (arrows, big
operators, relations, dots, braces, the radical sign) are drawn here as a few strokes each, the way people write
them. Each glyph is fitted into the box mathtext gives it, then jittered: its own scale, rotation and baseline
shift, a wobble along every stroke, and a slant shared by the whole expression. The strokes are then rasterised
by `rasterize_traces`, the very code that draws real CROHME ink, so the images follow data=crohme's conventions.
"""

from functools import cache, lru_cache

import numpy as np

# Hershey fonts for letters, digits and punctuation, one per expression, with their chances: the single-line
# (simplex) sets only, as a pen writes; the duplex and triplex sets draw each line twice
TEXT_FONTS = ("futural", "rowmans", "scripts", "cursive")
TEXT_FONT_WEIGHTS = (0.35, 0.3, 0.2, 0.15)


def text_font(rng: np.random.Generator) -> str:
    """One of TEXT_FONTS, by their chances: an expression's font (and, with data.font_mix, a glyph's own)."""
    return TEXT_FONTS[int(rng.choice(len(TEXT_FONTS), p=TEXT_FONT_WEIGHTS))]


# the Greek set's Latin keys
GREEK_KEYS = {
    "\\alpha": "a",
    "\\beta": "b",
    "\\gamma": "g",
    "\\delta": "d",
    "\\theta": "q",
    "\\lambda": "l",
    "\\mu": "m",
    "\\pi": "p",
    "\\sigma": "s",
    "\\phi": "f",
}


def _dot(x: float, y: float) -> list[tuple[float, float]]:
    return [(x, y)]  # a single point: the rasteriser draws a round dot


def _arc(cx, cy, rx, ry, a0, a1, n=12):
    t = np.linspace(np.radians(a0), np.radians(a1), n)
    return list(zip(cx + rx * np.cos(t), cy + ry * np.sin(t)))


# Strokes of the symbols the stroke fonts do not have, in a unit box: x right, y down, both 0..1.
DRAWN = {
    "\\rightarrow": [[(0, 0.5), (1, 0.5)], [(0.72, 0.15), (1, 0.5), (0.72, 0.85)]],
    "\\ldots": [_dot(0.05, 0.5), _dot(0.5, 0.5), _dot(0.95, 0.5)],
    "\\cdots": [_dot(0.05, 0.5), _dot(0.5, 0.5), _dot(0.95, 0.5)],
    "\\cdot": [_dot(0.5, 0.5)],
    "\\prime": [[(0.8, 0), (0.2, 1)]],
    "\\exists": [[(0, 0), (1, 0), (1, 1), (0, 1)], [(0.2, 0.5), (1, 0.5)]],
    "\\forall": [[(0, 0), (0.5, 1), (1, 0)], [(0.22, 0.45), (0.78, 0.45)]],
    "\\in": [_arc(1, 0.5, 1, 0.5, 270, 90, 14)[::-1], [(0, 0.5), (1, 0.5)]],
    "\\leq": [[(1, 0), (0, 0.38), (1, 0.76)], [(0, 1), (1, 1)]],
    "\\geq": [[(0, 0), (1, 0.38), (0, 0.76)], [(0, 1), (1, 1)]],
    "\\neq": [[(0, 0.3), (1, 0.3)], [(0, 0.7), (1, 0.7)], [(0.75, 0), (0.25, 1)]],
    "\\Delta": [[(0.5, 0), (0, 1), (1, 1), (0.5, 0)]],
    "\\infty": [
        [
            (0.5, 0.5),
            *_arc(0.25, 0.5, 0.25, 0.45, 0, -360, 24)[1:-1],
            (0.5, 0.5),
            *_arc(0.75, 0.5, 0.25, 0.45, 180, 540, 24)[1:],
        ]
    ],
    "\\sum": [[(1, 0.08), (1, 0), (0, 0), (0.55, 0.5), (0, 1), (1, 1), (1, 0.92)]],
    "\\int": [
        [(1, 0.06), (0.85, 0), (0.68, 0.05), (0.56, 0.3), (0.44, 0.7), (0.32, 0.95), (0.15, 1), (0, 0.94)]
    ],
    "\\times": [[(0, 0), (1, 1)], [(1, 0), (0, 1)]],
    "\\div": [[(0, 0.5), (1, 0.5)], _dot(0.5, 0.1), _dot(0.5, 0.9)],
    "\\pm": [[(0.5, 0), (0.5, 0.7)], [(0, 0.35), (1, 0.35)], [(0, 1), (1, 1)]],
    "\\{": [[(0.9, 0), (0.45, 0.06), (0.5, 0.44), (0.1, 0.5), (0.5, 0.56), (0.45, 0.94), (0.9, 1)]],
    "\\}": [[(0.1, 0), (0.55, 0.06), (0.5, 0.44), (0.9, 0.5), (0.5, 0.56), (0.55, 0.94), (0.1, 1)]],
    "\N{MINUS SIGN}": [[(0, 0.5), (1, 0.5)]],
    "-": [[(0, 0.5), (1, 0.5)]],
    "=": [[(0, 0.2), (1, 0.2)], [(0, 0.8), (1, 0.8)]],
    "+": [[(0.5, 0), (0.5, 1)], [(0, 0.5), (1, 0.5)]],
}
RADICAL = [(0, 0.6), (0.18, 0.5), (0.45, 1), (1, 0)]  # the sign; its bar continues from the last point

# Other forms of the symbols CROHME writers write most, as hands write them and the four stroke fonts do not
# (data.allographs): a 1 as a bare bar, a looped 2, a flat-topped 3, an open 4, a 7 with its bar, a 9 of a loop and a
# straight stem, an x of two arcs, a y as a u with a tail, a z with its bar, a single-storey a... In a unit box
# (x right, y down), stretched to the glyph's box like the fonts' glyphs.
# fmt: off
ALLOGRAPHS = {
    "1": [
        [[(0.5, 0), (0.5, 1)]],
        [[(0.1, 0.25), (0.6, 0), (0.6, 1)]],
        [[(0.2, 0.2), (0.55, 0), (0.55, 1)], [(0.15, 1), (0.95, 1)]],
    ],
    "2": [
        [[*_arc(0.5, 0.3, 0.42, 0.3, 200, 380, 10),
          (0.1, 0.95), (0.05, 0.85), (0.2, 0.8), (0.4, 0.95), (0.7, 1), (1, 0.95)]],
        [[*_arc(0.5, 0.3, 0.42, 0.3, 200, 380, 10), (0.02, 1), (1, 1)]],
    ],
    "3": [
        [[(0.05, 0), (0.9, 0), (0.4, 0.38), *_arc(0.45, 0.68, 0.5, 0.32, 270, 500, 10)]],
        [[*_arc(0.45, 0.25, 0.45, 0.25, 200, 450, 9), *_arc(0.45, 0.73, 0.5, 0.27, 270, 500, 9)]],
    ],
    "4": [
        [[(0.5, 0), (0.05, 0.65), (1, 0.65)], [(0.75, 0.3), (0.75, 1)]],
        [[(0.1, 0), (0.05, 0.6), (1, 0.6)], [(0.72, 0), (0.72, 1)]],
    ],
    "5": [[[(0.15, 0), (0.1, 0.45), *_arc(0.5, 0.68, 0.45, 0.32, 240, 500, 10)], [(0.15, 0), (0.95, 0)]]],
    "7": [
        [[(0, 0.05), (1, 0), (0.35, 1)], [(0.3, 0.5), (0.9, 0.5)]],
        [[(0, 0.12), (0.05, 0), (1, 0), (0.55, 0.5), (0.4, 1)]],
    ],
    "8": [[_arc(0.5, 0.25, 0.3, 0.25, 90, 450, 16), _arc(0.5, 0.72, 0.38, 0.28, -90, 270, 16)]],
    "9": [[[*_arc(0.45, 0.3, 0.42, 0.3, 0, -360, 16), (0.87, 0.1), (0.82, 1)]]],
    "x": [
        [[(0.05, 0.12), (0.3, 0), (0.48, 0.25), (0.5, 0.5), (0.48, 0.75), (0.3, 1), (0.05, 0.88)],
         [(0.95, 0.12), (0.7, 0), (0.52, 0.25), (0.5, 0.5), (0.52, 0.75), (0.7, 1), (0.95, 0.88)]],
        [[(0, 0.25), (0.2, 0.02), (0.4, 0.1), (0.6, 0.9), (0.8, 1), (1, 0.75)], [(1, 0), (0, 1)]],
    ],
    "y": [
        [[(0, 0), (0.05, 0.35), (0.3, 0.5), (0.6, 0.38), (0.75, 0)],
         [(0.78, 0), (0.75, 0.75), (0.55, 1), (0.2, 0.92)]],
        [[(0, 0), (0.45, 0.5)], [(0.95, 0), (0.45, 0.5), (0.2, 1)]],
    ],
    "z": [
        [[(0, 0), (1, 0), (0, 1), (1, 1)], [(0.2, 0.5), (0.8, 0.5)]],
        [[(0.05, 0.1), (0.3, 0), (0.9, 0.05), (0.1, 0.95), (0.4, 0.9), (1, 1)]],
    ],
    "a": [[[*_arc(0.45, 0.5, 0.42, 0.48, -30, -360, 16), (0.9, 0.05), (0.9, 0.85), (1, 1)]]],
    "b": [[[(0.12, 0), (0.1, 1), (0.12, 0.6), (0.45, 0.42), (0.85, 0.55), (0.9, 0.8), (0.65, 1), (0.3, 1),
            (0.1, 0.9)]]],
    "d": [[[*_arc(0.42, 0.72, 0.4, 0.28, -20, -360, 14), (0.85, 0), (0.85, 1)]]],
    "e": [[[(0.1, 0.55), (0.85, 0.45), (0.8, 0.15), (0.5, 0), (0.15, 0.2), (0.05, 0.6), (0.3, 0.95), (0.6, 1),
            (0.95, 0.85)]]],
    "f": [[[(0.9, 0.1), (0.7, 0), (0.5, 0.1), (0.45, 0.5), (0.4, 0.9), (0.2, 1), (0.05, 0.92)],
           [(0.15, 0.4), (0.8, 0.4)]]],
    "g": [[[*_arc(0.45, 0.27, 0.42, 0.27, -20, -360, 14), (0.88, 0), (0.85, 0.8), (0.6, 1), (0.3, 1),
            (0.1, 0.85)]]],
    "h": [[[(0.1, 0), (0.1, 1), (0.12, 0.6), (0.4, 0.42), (0.75, 0.45), (0.9, 0.6), (0.9, 1)]]],
    "i": [[[(0.5, 0.3), (0.5, 1)], _dot(0.5, 0)]],
    "j": [[[(0.6, 0.3), (0.6, 0.85), (0.4, 1), (0.1, 0.9)], _dot(0.6, 0)]],
    "k": [[[(0.1, 0), (0.1, 1)], [(0.85, 0.35), (0.1, 0.68), (0.9, 1)]]],
    "m": [[[(0.02, 0), (0.02, 1), (0.05, 0.3), (0.2, 0.02), (0.4, 0.05), (0.5, 0.3), (0.5, 1), (0.52, 0.3),
            (0.7, 0.02), (0.9, 0.05), (0.98, 0.3), (0.98, 1)]]],
    "n": [[[(0.05, 0), (0.05, 1), (0.08, 0.4), (0.35, 0.05), (0.7, 0.02), (0.9, 0.3), (0.92, 1)]]],
    "p": [[[(0.1, 0), (0.1, 1)], [(0.1, 0.1), (0.5, 0), (0.9, 0.15), (0.9, 0.4), (0.5, 0.55), (0.1, 0.45)]]],
    "q": [[[*_arc(0.45, 0.27, 0.42, 0.27, -20, -360, 14), (0.88, 0), (0.88, 1), (1, 0.85)]]],
    "r": [[[(0.1, 0), (0.1, 1), (0.12, 0.45), (0.4, 0.08), (0.7, 0), (0.95, 0.1)]]],
    "t": [
        [[(0.5, 0), (0.5, 1)], [(0.1, 0.3), (0.9, 0.3)]],
        [[(0.45, 0), (0.45, 0.85), (0.6, 1), (0.9, 0.9)], [(0.05, 0.3), (0.85, 0.3)]],
    ],
    "\\alpha": [[[(0.95, 0.1), (0.8, 0.45), (0.55, 0.85), (0.3, 0.98), (0.08, 0.85), (0.02, 0.5), (0.12, 0.15),
                  (0.35, 0.02), (0.55, 0.15), (0.75, 0.6), (1, 0.98)]]],
    "\\theta": [[_arc(0.5, 0.5, 0.45, 0.5, -90, 270, 18), [(0.08, 0.5), (0.92, 0.5)]]],
    "\\pi": [[[(0, 0.12), (0.3, 0.02), (1, 0)], [(0.3, 0.05), (0.25, 1)], [(0.72, 0.03), (0.78, 0.9), (0.9, 1)]]],
}

# More forms, of the frequent CROHME symbols ALLOGRAPHS leaves to the fonts (data.more_forms): a 0 started at its top
# and overshot, and one left open; a 6 of a curl and of a straight stem; a c closed further and a flat one; a looped l
# and one with a foot; an s, two u's, two v's, two B's; brackets pointed and flat in the middle; a one-stroke beta.
MORE_FORMS = {
    "0": [[_arc(0.5, 0.5, 0.45, 0.5, -90, -470, 20)], [_arc(0.5, 0.5, 0.42, 0.5, -60, 250, 18)]],
    "6": [
        [[(0.8, 0.05), (0.5, 0), (0.22, 0.2), (0.08, 0.55), (0.15, 0.88), (0.45, 1), (0.78, 0.9), (0.88, 0.68),
          (0.65, 0.5), (0.3, 0.52), (0.1, 0.68)]],
        [[(0.7, 0), (0.2, 0.6), *_arc(0.5, 0.72, 0.38, 0.28, 180, 540, 14)]],
    ],
    "c": [
        [_arc(0.55, 0.5, 0.45, 0.5, -45, -315, 12)],
        [[(0.95, 0.15), (0.6, 0), (0.2, 0.15), (0.05, 0.55), (0.3, 0.95), (0.7, 1), (1, 0.85)]],
    ],
    "l": [
        [[(0.05, 0.8), (0.45, 0.45), (0.75, 0.12), (0.6, 0), (0.4, 0.15), (0.3, 0.6), (0.4, 0.95), (0.7, 1),
          (0.95, 0.85)]],
        [[(0.35, 0), (0.35, 0.85), (0.55, 1), (0.9, 0.95)]],
    ],
    "s": [[[(0.9, 0.12), (0.6, 0), (0.2, 0.05), (0.1, 0.28), (0.5, 0.5), (0.9, 0.72), (0.8, 0.95), (0.4, 1),
            (0.05, 0.88)]]],
    "u": [
        [[(0, 0), (0.03, 0.7), (0.25, 1), (0.65, 0.95), (0.9, 0.55), (0.93, 0), (0.95, 1)]],
        [[(0, 0), (0.05, 0.7), (0.3, 1), (0.7, 1), (0.95, 0.7), (1, 0)]],
    ],
    "v": [[[(0, 0), (0.45, 1), (0.9, 0.1), (1, 0)]], [[(0, 0), (0.3, 0.85), (0.5, 1), (0.7, 0.8), (1, 0)]]],
    "B": [
        [[(0.12, 0), (0.1, 1)], [(0.1, 0.02), (0.6, 0), (0.85, 0.12), (0.8, 0.35), (0.45, 0.48), (0.15, 0.5),
                                 (0.6, 0.52), (0.95, 0.7), (0.9, 0.92), (0.55, 1), (0.1, 0.98)]],
        [[(0.1, 1), (0.1, 0), (0.7, 0.05), (0.8, 0.3), (0.2, 0.5), (0.85, 0.65), (0.85, 0.95), (0.1, 1)]],
    ],
    "(": [[[(1, 0), (0.2, 0.25), (0, 0.5), (0.2, 0.75), (1, 1)]], [[(1, 0), (0.1, 0.15), (0, 0.5), (0.1, 0.85), (1, 1)]]],
    ")": [[[(0, 0), (0.8, 0.25), (1, 0.5), (0.8, 0.75), (0, 1)]], [[(0, 0), (0.9, 0.15), (1, 0.5), (0.9, 0.85), (0, 1)]]],
    "\\beta": [[[(0.15, 1), (0.18, 0.3), (0.35, 0.02), (0.65, 0), (0.78, 0.2), (0.45, 0.42), (0.85, 0.55),
                  (0.9, 0.8), (0.6, 0.95), (0.2, 0.85)]]],
}
# Other shapes of a root's sign (data.more_forms), as RADICAL: a plain check, a hooked one, a steep one
RADICALS = (
    [(0.05, 0.55), (0.45, 1), (1, 0)],
    [(0, 0.72), (0.15, 0.55), (0.3, 0.62), (0.5, 1), (1, 0)],
    [(0.1, 0.5), (0.22, 0.45), (0.3, 1), (1, 0)],
)
# fmt: on
assert (
    not MORE_FORMS.keys() & ALLOGRAPHS.keys()
)  # each symbol's forms in one table: data.allographs or more_forms


@cache
def _font(name: str):
    from HersheyFonts import HersheyFonts

    font = HersheyFonts()
    font.load_default_font(name)
    return font


@lru_cache(maxsize=4096)
def _font_glyph(font: str, char: str) -> tuple[tuple[tuple[float, float], ...], ...] | None:
    """The strokes of `char` in a Hershey font, in the font's units (y down), or None when it has none."""
    strokes = tuple(
        tuple((float(x), float(y)) for x, y in s) for s in _font(font).strokes_for_text(char) if s
    )
    return strokes or None


def unit_strokes(c: str, text_font: str) -> list[np.ndarray] | None:
    """The strokes of mathtext glyph `c` (a character or a symbol's name, as mathtext's Char holds it) in a unit
    box (x right, y down); None for a glyph neither the fonts nor DRAWN have."""
    if c in DRAWN:
        return [np.asarray(s, dtype=np.float64) for s in DRAWN[c]]
    if c in GREEK_KEYS:
        strokes = _font_glyph("greek", GREEK_KEYS[c])
    elif len(c) == 1 and c.isascii() and c.isprintable() and not c.isspace():
        strokes = _font_glyph(text_font, c)
    else:
        return None
    if strokes is None:
        return None
    return to_unit(strokes)


def to_unit(strokes) -> list[np.ndarray]:
    """Strokes moved and scaled to span the unit box (an axis they do not span: 0.5)."""
    out = [np.asarray(s, dtype=np.float64) for s in strokes]
    pts = np.concatenate(out)
    lo, span = pts.min(0), np.ptp(pts, 0)
    return [np.where(span > 0, (s - lo) / np.where(span > 0, span, 1), 0.5) for s in out]


def allograph(c: str, rng: np.random.Generator, chance: float, more: float = 0.0) -> list[np.ndarray] | None:
    """With probability `chance` (data.allographs), one of the other forms of glyph `c` (ALLOGRAPHS) in the unit
    box, each form as likely; for a glyph of MORE_FORMS, the same with probability `more` (data.more_forms); else
    None (the fonts draw it). Draws from `rng` only for a glyph that has other forms, and only when its chance > 0."""
    table, p = ("more", more) if c in MORE_FORMS else ("base", chance)
    forms = _unit_forms(c, table) if p > 0 else ()
    if not forms or rng.random() >= p:
        return None
    return forms[int(rng.integers(len(forms)))]


@cache
def _unit_forms(c: str, table: str = "base") -> tuple[list[np.ndarray], ...]:
    """The other forms of glyph `c` (ALLOGRAPHS, or MORE_FORMS for `table` "more"), each moved and scaled into the
    unit box once (read-only)."""
    forms = MORE_FORMS if table == "more" else ALLOGRAPHS
    return tuple(to_unit(form) for form in forms.get(c, ()))


def _wobble(stroke: np.ndarray, rng: np.random.Generator, amount: float) -> np.ndarray:
    """The stroke resampled finely and bent by a smooth random offset of about `amount` (a shaky hand)."""
    if len(stroke) < 2 or amount <= 0:
        return stroke
    seg = np.hypot(*np.diff(stroke, axis=0).T)
    length = float(seg.sum())
    if length <= 0:
        return stroke
    n = int(min(64, max(len(stroke), length / max(amount, 1e-6) * 0.5)))
    t = np.concatenate([[0], np.cumsum(seg)]) / length
    u = np.linspace(0, 1, max(n, 2))
    # keep the corners: the original points plus an even resampling
    u = np.union1d(u, t)
    pts = np.stack([np.interp(u, t, stroke[:, 0]), np.interp(u, t, stroke[:, 1])], 1)
    phase = rng.uniform(0, 2 * np.pi, (2, 2))
    freq = rng.uniform(0.5, 2.0, 2)
    offset = np.stack(
        [
            np.sin(2 * np.pi * freq[k] * u + phase[0, k])
            + 0.5 * np.sin(4 * np.pi * freq[k] * u + phase[1, k])
            for k in (0, 1)
        ],
        1,
    )
    return pts + amount * offset / 1.5


def bank_token(c: str) -> str | None:
    """The CROHME token whose real ink draws mathtext glyph `c` (data.glyphs=crohme), or None."""
    if c in ("\N{MINUS SIGN}", "-"):
        return "-"
    if len(c) == 1 and c.isascii() and c.isprintable() and not c.isspace():
        return c
    if c.startswith("\\") and not c.startswith("\\__"):
        return c
    return None


def bank_sample(bank, token: str | None, rng: np.random.Generator) -> list[np.ndarray] | None:
    """One real sample of `token` from `bank` (ink.bank.Bank), drawn by `rng`; a prime stands in for "'" and back."""
    if bank is None or token is None:
        return None
    samples = bank.get(token) or bank.get({"'": "\\prime", "\\prime": "'"}.get(token, ""))
    if not samples:
        return None
    return samples[int(rng.integers(len(samples)))]


def fit(strokes: list[np.ndarray], box: tuple, keep_aspect: bool = True) -> list[np.ndarray]:
    """Strokes moved and scaled into `box` (x0, y0, x1, y1): with `keep_aspect`, as large as fits and centred
    (flat ink, a minus, by its width); else stretched to fill it."""
    pts = np.concatenate(strokes)
    lo, span = pts.min(0), np.ptp(pts, 0)
    x0, y0, x1, y1 = (float(v) for v in box)
    w, h = max(x1 - x0, 1e-6), max(y1 - y0, 1e-6)
    if keep_aspect:
        sx = w / span[0] if span[0] > 0 else np.inf
        sy = h / span[1] if span[1] > 0 else np.inf
        s = min(sx, sy)
        if not np.isfinite(s) or span[1] < 0.2 * span[0]:  # flat ink: its width decides
            s = sx if np.isfinite(sx) else (sy if np.isfinite(sy) else 1.0)
        scale = np.array([s, s])
    else:
        scale = np.array([w / span[0] if span[0] > 0 else 1.0, h / span[1] if span[1] > 0 else 1.0])
    centre = np.array([(x0 + x1) / 2, (y0 + y1) / 2])
    return [(s - lo - span / 2) * scale + centre for s in strokes]


def draw_glyph(
    c: str,
    box: tuple,
    size: float,
    text_font: str,
    rng: np.random.Generator,
    jitter: float = 1.0,
    bank=None,
    distort: float = 0.0,
    allographs: float = 0.0,
    more_forms: float = 0.0,
) -> list[np.ndarray]:
    """The strokes of glyph `c` fitted into `box` (x0, y0, x1, y1, y down) of an expression whose font size is
    `size` (the same units), jittered by `rng` (`jitter` 0 = exactly in the box). With `bank` (ink.bank.Bank),
    a real written sample of the symbol when the bank has one, else the stroke fonts, or with probability
    `allographs` another hand-written form of the symbol (ALLOGRAPHS; MORE_FORMS with `more_forms`). With `distort` > 0 the glyph's shape
    changes too (see `distort_glyph`), with or without the jitter."""
    x0, y0, x1, y1 = (float(v) for v in box)
    real = bank_sample(bank, bank_token(c), rng)
    if real is not None:
        strokes = fit(real, box)
    else:
        unit = allograph(c, rng, allographs, more_forms) or unit_strokes(c, text_font)
        if unit is None:  # a glyph no source draws: a stroke across its box, so that it is not invisible
            unit = [np.array([(0.0, 0.5), (1.0, 0.5)])]
        w, h = max(x1 - x0, 0.0), max(y1 - y0, 0.0)
        strokes = [np.stack([x0 + s[:, 0] * w, y0 + s[:, 1] * h], 1) for s in unit]
    if jitter <= 0:
        return distort_glyph(strokes, size, rng, distort) if distort > 0 else strokes
    centre = np.array([(x0 + x1) / 2, (y0 + y1) / 2])
    out = jitter_glyph(strokes, centre, size, rng, jitter)
    if real is None:  # real ink shakes already
        out = [_wobble(s, rng, 0.025 * jitter * size) for s in out]
    return distort_glyph(out, size, rng, distort) if distort > 0 else out


def jitter_glyph(
    strokes: list[np.ndarray],
    centre: np.ndarray,
    size: float,
    rng: np.random.Generator,
    jitter: float,
    turn: float | None = None,
) -> list[np.ndarray]:
    """The glyph's strokes scaled (8 %, and 5 % more per axis), turned (4 degrees) and moved (5 % of `size`) about
    `centre` as one, every figure times `jitter` (the turn times `turn` when given)."""
    scale = np.exp(rng.normal(0, 0.08 * jitter)) * np.exp(rng.normal(0, 0.05 * jitter, 2))
    angle = np.radians(rng.normal(0, 4.0 * (jitter if turn is None else turn)))
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    shift = rng.normal(0, 0.05 * jitter, 2) * size
    return [(s - centre) * scale @ rot.T + centre + shift for s in strokes]


def distort_glyph(
    strokes: list[np.ndarray], size: float, rng: np.random.Generator, amount: float
) -> list[np.ndarray]:
    """The glyph's shape changed as another hand would write it (data.distort): each stroke gets its own shift (3 %
    of `size`), rotation (5 degrees) and scale (8 %) about its own centre, so that strokes meet a little apart, and
    then the whole glyph is bent by a smooth random field, two sine waves of about one cycle per symbol displacing
    points by up to 6 % of `size`; every figure is multiplied by `amount`. Draws from `rng` only when called."""
    out = []
    for s in strokes:
        centre = s.mean(0)
        angle = np.radians(rng.normal(0, 5.0 * amount))
        rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        scale = np.exp(rng.normal(0, 0.08 * amount))
        shift = rng.normal(0, 0.03 * amount, 2) * size
        out.append((s - centre) * scale @ rot.T + centre + shift)
    pts = np.concatenate(out)
    centre = (pts.min(0) + pts.max(0)) / 2
    # per displaced axis, a wave vector of 0.5 to 1.5 cycles per `size` in a random direction, and a phase
    turn = rng.uniform(0, 2 * np.pi, 2)
    cycles = rng.uniform(0.5, 1.5, 2) * 2 * np.pi / max(size, 1e-6)
    waves = np.stack([np.cos(turn), np.sin(turn)], 1) * cycles[:, None]  # (2 axes, 2)
    phase = rng.uniform(0, 2 * np.pi, 2)
    amp = rng.uniform(0.5, 1.0, 2) * 0.06 * amount * size
    return [s + amp * np.sin((s - centre) @ waves.T + phase) for s in out]


def draw_radical(
    sign_box: tuple,
    bar_end: float,
    bar_y: float,
    rng: np.random.Generator,
    jitter: float,
    size: float,
    bank=None,
    more_forms: float = 0.0,
):
    """A root's sign and bar as one stroke: the sign in `sign_box` (RADICAL, or with probability `more_forms` one
    of RADICALS), the bar on to x = `bar_end` at height `bar_y`; with `bank`, a real written root stretched over the
    same span."""
    x0, y0, x1, y1 = (float(v) for v in sign_box)
    real = bank_sample(bank, "\\sqrt", rng)
    if real is not None:
        return fit(real, (x0, min(y0, bar_y), bar_end, y1), keep_aspect=False)
    sign = RADICAL
    if more_forms > 0 and rng.random() < more_forms:  # no draw at 0: the images stay bit for bit
        sign = RADICALS[int(rng.integers(len(RADICALS)))]
    pts = np.array([(x0 + u * (x1 - x0), y0 + v * (y1 - y0)) for u, v in sign])
    pts = np.vstack([pts, [(bar_end, bar_y)]])
    pts[-2, 1] = pts[-1, 1] = min(y0, bar_y)
    if jitter > 0:
        pts = pts + rng.normal(0, 0.03 * jitter * size, pts.shape)
        pts = _wobble(pts, rng, 0.02 * jitter * size)
    return [pts]


def draw_rule(
    box: tuple, rng: np.random.Generator, jitter: float, size: float, bank=None
) -> list[np.ndarray]:
    """A fraction's bar (or any rule mathtext draws) as one slightly uneven stroke through its box's middle; with
    `bank`, a real written minus as wide as the rule."""
    x0, y0, x1, y1 = (float(v) for v in box)
    y = (y0 + y1) / 2
    real = bank_sample(bank, "-", rng)
    if real is not None:
        return fit(real, (x0, y, x1, y))
    pts = np.array([(x0, y), (x1, y)])
    if jitter > 0:
        pts = pts + rng.normal(0, 0.03 * jitter * size, pts.shape)
        pts = _wobble(pts, rng, 0.015 * jitter * size)
    return [pts]


def slant(strokes: list[np.ndarray], shear: float, y_mid: float) -> list[np.ndarray]:
    """The strokes sheared about the line y = `y_mid`: positive leans them to the right, as italics."""
    return [np.stack([s[:, 0] - shear * (s[:, 1] - y_mid), s[:, 1]], 1) for s in strokes]


# Where writers put a one-symbol script against its base, measured on the symbol boxes of the CROHME training files
# against mathtext's layout of the same shapes (docs/studies/handwriting.md, "What the zero-shot model gets wrong"), in base
# heights: a subscript is 0.75 times the size mathtext gives it, 0.14 lower and 0.19 further right; a superscript is
