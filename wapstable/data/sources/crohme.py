"""The data source data=crohme: folders of CROHME InkML (online pen strokes with a LaTeX truth), each file read into
a WAP-style image by wapstable.data.ink.read.

The published layout is read as it is: one training folder (all of its sources, recursively), a validation split
held out from it by expression (a hash of the normalised label, so no validation label occurs in training), and
named test sets (CROHME 2014, 2016) evaluated and reported one by one. Each folder is read and rasterised once and
cached under `data.cache_dir/crohme/`, keyed by its files (names, sizes, times) and the rendering settings.
"""

import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from wapstable.data.cache import check_writable, code_hash, pack_images, read_npz, unpack_images, write_npz
from wapstable.data.ink.raster import Raster
from wapstable.data.ink.read import read_inkml
from wapstable.data.ink.redraw import Redraw
from wapstable.data.latex import DataError, check_on_error, on_data_error
from wapstable.data.sample import Sample, Splits, data_root, held_out, no_boxes
from wapstable.data.sources.base import DataSource
from wapstable.errors import UserError

log = logging.getLogger(__name__)


class FolderRead(NamedTuple):
    """A folder of InkML: its samples, one (reason, message) per file that could not be used, and its file count."""

    samples: list[Sample]
    errors: list[tuple[str, str]]
    total: int

    def reasons(self) -> dict[str, int]:
        return dict(Counter(reason for reason, _ in self.errors))


# The code that turns a file into a sample (the reader, the rasteriser and data.redraw's strokes: the ink package; the
# label normaliser; the glyph distortions data.redraw uses; the file's layout): a change to any of its modules
# reads every folder again by itself (cache.code_hash).
READING_CODE = (
    "wapstable.data.sources.crohme",
    "wapstable.data.ink",
    "wapstable.data.latex",
    "wapstable.data.render.glyphs",
    "wapstable.data.cache",
)
# 2: each sample's symbol boxes (from the traceGroups) are cached beside its pixels
# 3: bare groups' braces dropped and a superscript put after its subscript by the normaliser
CACHE_FORMAT = 3


def _folder_key(folder: Path, files: list[Path], raster: Raster, redraw: Redraw | None = None) -> str:
    """The cache key of `folder`'s samples: its files (names, sizes, times), the raster, the drawing and the code."""
    listing = [(str(f.relative_to(folder)), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    drawing = (
        [] if redraw is None else [redraw._asdict()]
    )  # the file's own drawing keeps the keys it always had
    blob = json.dumps([CACHE_FORMAT, code_hash(*READING_CODE), raster._asdict(), listing, *drawing])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save_folder(path: Path, read: FolderRead) -> None:
    shapes, pixels = pack_images([s.image for s in read.samples])
    arrays = {
        "ids": np.array([s.id for s in read.samples], dtype=str),
        "tokens": np.array([" ".join(s.tokens) for s in read.samples], dtype=str),
        "shapes": shapes,
        "pixels": pixels,
        "meta": np.array(json.dumps({"errors": read.errors, "total": read.total})),
        # one row per token of every label in turn; a sample without boxes has NaN rows and has_boxes False
        "boxes": np.concatenate(
            [s.boxes if s.boxes is not None else no_boxes(len(s.tokens)) for s in read.samples]
            or [no_boxes(0)]
        ),
        "has_boxes": np.array([s.boxes is not None for s in read.samples], dtype=bool),
    }
    write_npz(path, arrays)


def _load_folder(z) -> FolderRead:
    """The FolderRead of an open cache file `z`; ValueError when its arrays disagree."""
    meta = json.loads(str(z["meta"]))
    ids, labels, images = z["ids"], z["tokens"], unpack_images(z["shapes"], z["pixels"])
    if not len(ids) == len(labels) == len(images):
        raise ValueError("the arrays do not agree")
    tokens = [str(t).split(" ") for t in labels]
    ends = np.cumsum([len(t) for t in tokens], dtype=np.int64)
    boxes, has = z["boxes"], z["has_boxes"]
    if boxes.shape != (int(ends[-1]) if len(ends) else 0, 4) or len(has) != len(ids):
        raise ValueError("the boxes do not agree with the labels")
    samples = [
        Sample(str(i), im, t, boxes[end - len(t) : end] if ok else None)
        for i, t, im, end, ok in zip(ids, tokens, images, ends, has)
    ]
    return FolderRead(samples, [tuple(e) for e in meta["errors"]], int(meta["total"]))


def _read_one(job) -> tuple[Sample | None, tuple[str, str] | None]:
    """read_inkml of one (path, raster, redraw) job in a worker: the sample, or the (reason, message) of its error."""
    try:
        return read_inkml(*job), None
    except DataError as e:
        return None, (e.reason, str(e))


def read_folder(
    folder: str | Path,
    raster: Raster,
    cache_dir: str | Path | None = None,
    redraw: Redraw | None = None,
    workers: int = 0,
) -> FolderRead:
    """Every `*.inkml` under `folder` (recursively, sorted) read as Samples, with a progress bar, by `workers`
    processes (data.render_workers; 0 or 1: in this one); cached under `cache_dir/crohme/` when given. With
    `redraw`, each file's strokes as another hand would write them (read_inkml), cached apart. A missing folder, or
    one without InkML files, raises DataError."""
    folder = Path(folder)
    hint = "set data.root to the CROHME folder, and data.train / data.test_sets to folders under it"
    if not folder.is_dir():
        raise DataError(f"the CROHME folder {folder} does not exist; {hint}")
    files = sorted(folder.rglob("*.inkml"))
    if not files:
        raise DataError(f"the CROHME folder {folder} has no .inkml files; {hint}")
    cache = None
    if cache_dir:
        key = _folder_key(folder, files, raster, redraw)
        cache = Path(cache_dir).expanduser() / "crohme" / key / f"{folder.name}.npz"
        read = read_npz(cache, _load_folder, f"reading {folder} again")
        if read is not None:
            log.info("loaded %d CROHME samples of %s from %s", len(read.samples), folder, cache)
            return read
        check_writable(cache.parent)  # before the reading, not after
    from tqdm import tqdm

    samples, errors, seen = [], [], {}
    desc = f"reading {folder.name}" if redraw is None else f"drawing {folder.name} again ({redraw.index})"
    jobs = [(f, raster, redraw) for f in files]
    with contextlib.ExitStack() as stack:
        if workers > 1 and len(files) > 1:
            method = "fork" if "fork" in mp.get_all_start_methods() else None
            pool = stack.enter_context(mp.get_context(method).Pool(min(workers, len(files))))
            read = pool.imap(_read_one, jobs, chunksize=32)
        else:
            read = map(_read_one, jobs)
        results = list(
            tqdm(read, total=len(jobs), desc=desc, unit="file", mininterval=2, disable=len(files) < 200)
        )
    for f, (s, error) in zip(files, results):
        if error is not None:
            errors.append(error)
            continue
        if s.id in seen:  # ids key predictions and checkpoints, so they must be unique
            errors.append(("duplicate id", f"{f}: id {s.id!r} already used by {seen[s.id]}"))
            continue
        seen[s.id] = f
        samples.append(s)
    read = FolderRead(samples, errors, len(files))
    if cache is not None:
        _save_folder(cache, read)
    return read


def load_crohme_split(
    folder: str | Path, raster: Raster, on_error: str, cache_dir=None, workers: int = 0
) -> FolderRead:
    """A folder of InkML (read_folder) with data.on_error applied to its bad files: the first one raises
    ("fail"), or each is logged ("skip")."""
    check_on_error(on_error)
    read = read_folder(folder, raster, cache_dir, workers=workers)
    for reason, message in read.errors:
        on_data_error(message, on_error, [], log, reason)
    return read


def _workers(cfg_data) -> int:
    return int(cfg_data.get("render_workers") or 0)


def redrawn(folder: Path, raster: Raster, cfg_data, train_ids: set[str]) -> list[Sample]:
    """data.redraw more drawings of each training file in `train_ids` (the files left after the validation
    hold-out), each as another hand would write it (read_inkml with a Redraw), read once and cached."""
    n, strength = cfg_data.get("redraw", 0), cfg_data.get("redraw_strength", 1.0)
    if not n:
        return []
    out = []
    for index in range(1, n + 1):
        read = read_folder(
            folder, raster, cfg_data.cache_dir, Redraw(index, float(strength)), _workers(cfg_data)
        )
        out += [s for s in read.samples if s.id.rsplit("~", 1)[0] in train_ids]
    log.info(
        "data.redraw=%d: %d more drawings of the %d training files (data.redraw_strength=%g)",
        n,
        len(out),
        len(train_ids),
        strength,
    )
    return out


def crohme_splits(cfg_data, which: Sequence[str]) -> Splits:
    """The splits of data=crohme under data.root (see the module docstring), with a report of what was skipped."""
    d = cfg_data
    root = data_root(d)
    raster = Raster.of(d)
    check_on_error(d.on_error)
    if not 0 <= d.valid_fraction < 1:
        raise UserError(f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    if not d.valid and d.valid_fraction <= 0:
        raise UserError(
            "data.valid is empty and data.valid_fraction=0: give a validation folder or a fraction > 0"
        )

    def read(part: str, label: str) -> FolderRead:
        r = load_crohme_split(root / part, raster, d.on_error, d.cache_dir, _workers(d))
        splits.report["skipped"][label] = r.reasons()
        splits.report["files"][label] = r.total
        splits.report["skipped_files"][label] = [message for _, message in r.errors]
        return r

    splits = Splits()
    if "train" in which or ("valid" in which and not d.valid):
        train = read(d.train, "train").samples
        if not d.valid:
            sides = {False: [], True: []}
            for s in train:
                sides[held_out(s.tokens, d.valid_fraction)].append(s)
            train, valid = sides[False], sides[True]
            if "valid" in which:
                splits["valid"] = valid
            log.info(
                "validation: %d of %d training files (%d distinct expressions) held out by label",
                len(valid),
                len(valid) + len(train),
                len({" ".join(s.tokens) for s in valid}),
            )
        if "train" in which:
            splits["train"] = train + redrawn(root / d.train, raster, d, {s.id for s in train})
    if "valid" in which and d.valid:
        splits["valid"] = read(d.valid, "valid").samples
    if "test" in which:
        sets = dict(d.test_sets) if d.test_sets else {"test": d.test}
        test = []
        for name, part in sets.items():
            r = read(part, f"test {name}")
            splits.report["test_sets"][str(name)] = r.total
            prefix = f"{name}/" if d.test_sets else ""
            test += [s._replace(id=prefix + s.id) for s in r.samples]
        splits["test"] = test
    for split, samples in splits.items():
        if not samples:
            raise UserError(
                f"the {split} split of data=crohme under {root} is empty; check data.root and data.{split}"
            )
    return splits


class CrohmeSource(DataSource):
    """`data=crohme`: folders of CROHME InkML files, rasterised (the module docstring); symbol boxes from their
    traceGroups, labels in the CROHME 2014 dictionary."""

    name = "crohme"
    boxes = True
    crohme_symbols = True

    def splits(self, cfg_data, which: Sequence[str]) -> Splits:
        return crohme_splits(cfg_data, which)
