"""Real handwritten symbols for data.style=handwritten (data.glyphs=crohme): the strokes of every symbol the CROHME
training files segment, cut out by their traceGroups (each names one symbol and its traces).

The bank is read once from `data.root/data.train` and cached under `data.cache_dir/glyphs/` (a torn file is cut
again). Files whose expression is held out for validation (`data.valid_fraction`, by the hash of its label, as
data=crohme holds it out) give no ink, so a CROHME run's validation writers' expressions stay unseen. Every symbol
keeps at most MAX_PER_SYMBOL samples, spread evenly over the sorted files (and so over the sources and writers).
"""

import hashlib
import json
import logging
import xml.etree.ElementTree as ET
from functools import lru_cache
from pathlib import Path

import numpy as np

from wapstable.data.cache import check_writable, code_hash, read_npz, write_npz
from wapstable.data.ink.inkml import DICTIONARY, local_tag, parse_trace, read_truth
from wapstable.data.latex import DataError, normalize_crohme, tokenize_latex
from wapstable.data.sample import held_out

log = logging.getLogger(__name__)

BANK_FORMAT = 2  # 2: roots (a lone \\sqrt truth) are kept
# The modules whose code cuts the symbols: a change to them cuts the bank again by itself (cache.code_hash).
CUTTING_CODE = (
    "wapstable.data.ink.bank",
    "wapstable.data.ink.inkml",
    "wapstable.data.latex",
    "wapstable.data.sample",
    "wapstable.data.cache",
)
MAX_PER_SYMBOL = 400
# what a traceGroup's symbol is drawn for: a fraction's bar is written as a minus
SAME_INK = {"\\frac": "-"}

Bank = dict[str, list[list[np.ndarray]]]  # token -> samples, each a list of (N, 2) strokes, y down


def read_symbols(path: Path) -> tuple[list[str], list[tuple[str, list[np.ndarray]]]]:
    """The file's label tokens and (token, strokes) for every traceGroup that names one dictionary symbol."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise DataError(f"{path}: not readable InkML ({e})", "malformed XML") from None
    tokens = read_truth(path, root)
    traces = {}
    for el in root.iter():
        if local_tag(el.tag) == "trace":
            try:
                traces[el.get("id")] = parse_trace(el.text or "")
            except ValueError:
                continue
    out = []
    for group in root.iter():
        if local_tag(group.tag) != "traceGroup":
            continue
        truth = next(
            (c.text for c in group if local_tag(c.tag) == "annotation" and c.get("type") == "truth"), None
        )
        refs = [c.get("traceDataRef") for c in group if local_tag(c.tag) == "traceView"]
        if not truth or not refs:
            continue
        truth = truth.strip()
        try:  # a symbol as it stands (\\sqrt, which alone does not parse), else as the labels normalise it
            symbol = [truth] if truth in DICTIONARY else normalize_crohme(tokenize_latex(truth))
        except DataError:
            continue
        if len(symbol) != 1 or symbol[0] not in DICTIONARY:
            continue
        strokes = [traces[r] for r in refs if r in traces and len(traces[r])]
        if strokes:
            out.append((SAME_INK.get(symbol[0], symbol[0]), strokes))
    return tokens, out


def _key(folder: Path, files: list[Path], valid_fraction: float) -> str:
    listing = [(str(f.relative_to(folder)), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    blob = json.dumps([BANK_FORMAT, code_hash(*CUTTING_CODE), MAX_PER_SYMBOL, float(valid_fraction), listing])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def bank_path(folder: str | Path, valid_fraction: float, cache_dir: str | Path) -> Path:
    """Where the bank of `folder` is cached: built (once) and written there when missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(
            f"data.glyphs=crohme reads symbols from {folder}, which does not exist; set data.root to the "
            "CROHME_labeled_2016 folder and data.train to its training folder"
        )
    files = sorted(folder.rglob("*.inkml"))
    if not files:
        raise DataError(f"data.glyphs=crohme: {folder} has no .inkml files to cut symbols from")
    path = cache_file(cache_dir, _key(folder, files, valid_fraction))
    if read_npz(path, _unpack, f"cutting the symbols of {folder} again") is None:
        check_writable(path.parent)  # before the cutting, not after
        _save(path, _build(files, valid_fraction))
    return path


def cache_file(cache_dir: str | Path, key: str) -> Path:
    """The cached bank of key `key` (a bank_path's folder name) under `cache_dir`."""
    return Path(cache_dir).expanduser() / "glyphs" / key / "bank.npz"


def _build(files: list[Path], valid_fraction: float) -> Bank:
    from tqdm import tqdm

    bank: Bank = {}
    skipped = 0
    for f in tqdm(files, desc="cutting symbols", unit="file", mininterval=2, disable=len(files) < 200):
        try:
            tokens, symbols = read_symbols(f)
        except DataError:
            skipped += 1
            continue
        if valid_fraction > 0 and held_out(tokens, valid_fraction):
            continue
        for token, strokes in symbols:
            bank.setdefault(token, []).append(strokes)
    for token, samples in bank.items():
        if len(samples) > MAX_PER_SYMBOL:
            keep = np.linspace(0, len(samples) - 1, MAX_PER_SYMBOL).round().astype(int)
            bank[token] = [samples[i] for i in keep]
    log.info(
        "cut %d symbols of %d kinds from %d files (%d unreadable)",
        sum(map(len, bank.values())),
        len(bank),
        len(files),
        skipped,
    )
    if not bank:
        raise DataError("data.glyphs=crohme: no file there has traceGroups that name their symbols")
    return bank


def _save(path: Path, bank: Bank) -> None:
    tokens, counts, lengths, points = [], [], [], []
    for token in sorted(bank):
        for strokes in bank[token]:
            tokens.append(token)
            counts.append(len(strokes))
            for s in strokes:
                lengths.append(len(s))
                points.append(np.asarray(s, dtype=np.float32)[:, :2])
    write_npz(
        path,
        {
            "format": np.array(BANK_FORMAT),
            "tokens": np.array(tokens, dtype=str),
            "counts": np.array(counts, dtype=np.int32),
            "lengths": np.array(lengths, dtype=np.int32),
            "points": np.concatenate(points),
        },
    )


@lru_cache(maxsize=2)
def load_bank(path: str) -> Bank:
    """The bank cached at `path` (bank_path, which checked it); loaded once per process (render workers fork with
    it)."""
    with np.load(path, allow_pickle=False) as z:
        return _unpack(z)


def _unpack(z) -> Bank:
    """The bank of an open cache file `z`; ValueError when it is of another format or its arrays disagree."""
    if int(z["format"]) != BANK_FORMAT:
        raise ValueError(f"a symbol bank of format {int(z['format'])}, not {BANK_FORMAT}")
    tokens, counts, lengths, points = z["tokens"], z["counts"], z["lengths"], z["points"]
    if len(tokens) != len(counts) or counts.sum() != len(lengths) or lengths.sum() != len(points):
        raise ValueError("the tokens, stroke counts, stroke lengths and points do not agree")
    if points.ndim != 2 or points.shape[1] != 2 or (counts < 1).any() or (lengths < 1).any():
        raise ValueError(f"{points.shape} points, or a symbol or stroke of none, are not a bank's")
    ends = np.cumsum(lengths)
    strokes = np.split(points.astype(np.float64), ends[:-1]) if len(lengths) else []
    bank: Bank = {}
    i = 0
    for token, n in zip(tokens, counts):
        bank.setdefault(str(token), []).append(strokes[i : i + n])
        i += n
    return bank
