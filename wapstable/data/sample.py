"""The one record every data source produces."""

from typing import NamedTuple

import numpy as np


class Sample(NamedTuple):
    """One expression: a grayscale image (ink bright on a dark background, as in WAP's pickles) and its tokens."""

    id: str
    image: np.ndarray  # (H, W) uint8, 0 = background, 255 = ink
    tokens: list[str]  # CROHME-style LaTeX tokens, e.g. ["\\frac", "{", "a", "}", "{", "b", "}"]
