"""data.redraw: a CROHME training file's strokes as another hand would write them, every symbol moved and bent on
its own, seeded by the file's name so a drawing is the same on every machine."""

import hashlib
from typing import NamedTuple

import numpy as np

from wapstable.data.render.glyphs import distort_glyph, jitter_glyph, slant


class Redraw(NamedTuple):
    """One more drawing of a training file in another hand (data.redraw): which drawing (1, 2, ...; with the file's
    name it seeds the randomness, so a drawing is the same on every machine) and how strong (data.redraw_strength)."""

    index: int
    strength: float = 1.0

    def rng(self, stem: str) -> np.random.Generator:
        digest = hashlib.sha256(f"{stem}/{self.index}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "big"))


def redraw_traces(
    traces: list[np.ndarray], groups: list[list[int]], rng: np.random.Generator, strength: float = 1.0
) -> list[np.ndarray]:
    """The expression's strokes as another hand would write them (data.redraw): every symbol (a group of traces)
    scaled (8 %, and 5 % more per axis), turned (4 degrees), moved (5 % of the symbol size) about its own centre,
    and its shape changed by render.glyphs.distort_glyph (each stroke moved on its own, the symbol bent); then the
    whole expression slanted (shear 0.1) and stretched across (6 %). Every figure is multiplied by `strength`.
    The symbol size is the median over the symbols of their larger side; a longer symbol is turned and bent no more
    at its ends than one of that size."""
    out = [np.asarray(t, dtype=np.float64)[:, :2].copy() for t in traces]
    drawn = [[i for i in g if len(out[i])] for g in groups]
    drawn = [g for g in drawn if g]
    if not drawn or strength <= 0:
        return out
    sides = [np.ptp(np.concatenate([out[i] for i in g]), axis=0).max() for g in drawn]
    size = float(np.median(sides)) or 1.0
    for g, side in zip(drawn, sides):
        pts = np.concatenate([out[i] for i in g])
        centre = (pts.min(0) + pts.max(0)) / 2
        # a symbol longer than the usual one (a fraction bar, a root's sign over a long radicand) is turned and bent
        # as one of the usual size would be at its ends: by an angle and a bend `short` times the figures, one
        # cycle of the bend along its whole length
        short = min(1.0, size / side) if side > 0 else 1.0
        moved = jitter_glyph([out[i] for i in g], centre, size, rng, strength, turn=strength * short)
        for i, stroke in zip(g, distort_glyph(moved, max(side, size), rng, strength * short)):
            out[i] = stroke
    pts = np.concatenate([t for t in out if len(t)])
    y_mid = (pts[:, 1].min() + pts[:, 1].max()) / 2
    shear = rng.normal(0, 0.1 * strength)
    stretch = np.exp(rng.normal(0, 0.06 * strength))
    return [t * (stretch, 1.0) for t in slant(out, shear, y_mid)]
