"""The one record every data source produces, what a source returns (its splits, with a report), and the policy that
holds a validation split out of a training folder by expression."""

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from wapstable.errors import UserError


class Sample(NamedTuple):
    """One expression: a grayscale image (ink bright on a dark background, as in WAP's pickles) and its tokens."""

    id: str
    image: np.ndarray  # (H, W) uint8, 0 = background, 255 = ink
    tokens: list[str]  # CROHME-style LaTeX tokens, e.g. ["\\frac", "{", "a", "}", "{", "b", "}"]
    # Where each token is drawn: (len(tokens), 4) float32 x0, y0, x1, y1 in the image's pixels (x1, y1 exclusive);
    # a NaN row for a token with no ink of its own ({, }, ^, _) or of unknown place. None: the source has none.
    boxes: np.ndarray | None = None


def no_boxes(n: int) -> np.ndarray:
    """Boxes of `n` tokens that have no place in the image (all NaN)."""
    return np.full((n, 4), np.nan, np.float32)


class Splits(dict):
    """split name -> samples, and `report`: what a reader skipped and why, per folder ("skipped": {folder: {reason:
    count}}), how many files each folder holds ("files"), and the size of each named test set ("test_sets": the
    denominator of its ExpRate, so an unreadable expression counts as wrong). Test samples of named sets have ids
    "SET/ID"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.report = {"skipped": {}, "files": {}, "test_sets": {}, "skipped_files": {}}


def data_root(cfg_data) -> Path:
    """data.root as a folder that exists, or a UserError naming the key."""
    name = cfg_data.name
    if not cfg_data.root:
        raise UserError(f"data={name} needs data.root, the folder that holds the data set")
    root = Path(cfg_data.root).expanduser()
    if not root.is_dir():
        raise UserError(f"data.root={cfg_data.root} is not a folder; set data.root to the {name} data folder")
    return root


def held_out(tokens: Sequence[str], fraction: float) -> bool:
    """Whether an expression belongs to the validation split: a hash of its normalised label, so every file of one
    expression falls on the same side, the same way on every machine."""
    digest = hashlib.sha256(" ".join(tokens).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
