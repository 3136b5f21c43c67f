"""CROHME InkML (online pen strokes with a LaTeX truth) rasterised to WAP-style images (data=crohme).

The published layout is read as it is: one training folder (all of its sources, recursively), a validation split
held out from it by expression (a hash of the normalised label, so no validation label occurs in training), and
named test sets (CROHME 2014, 2016) evaluated and reported one by one. Each folder is read and rasterised once and
cached under `data.cache_dir/crohme/`, keyed by its files (names, sizes, times) and the rendering settings.
"""

import contextlib
import hashlib
import json
import logging
import math
import multiprocessing as mp
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from wapstable.data.cache import check_writable, code_hash, pack_images, read_npz, unpack_images, write_npz
from wapstable.data.latex import (
    CROHME_2014_SYMBOLS,
    DataError,
    check_on_error,
    normalize_crohme,
    on_data_error,
    tokenize_latex,
)
from wapstable.data.sample import Sample, Splits, data_root, no_boxes
from wapstable.errors import UserError

log = logging.getLogger(__name__)

# Widest image, in multiples of its height: a long expression of tiny flat marks (dots, minus signs) would
# otherwise be scaled to thousands of pixels wide.
MAX_ASPECT = 32.0


def _local(tag: str) -> str:
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


def rasterize_traces(
    traces: list[np.ndarray],
    height: int,
    line_width: int,
    margin: int = 4,
    max_aspect: float = MAX_ASPECT,
    symbol_size: float = 0.0,
    transform: list | None = None,
) -> np.ndarray:
    """Draw pen strokes as an (H, W) uint8 image, ink 255 on 0.

    With `symbol_size` 0 the image is `height` rows: the ink is scaled to fill `height - 2*margin` rows with its
    aspect kept, except that flat ink (a lone minus) is scaled as if as tall as its median stroke is long, centred
    vertically. With `symbol_size` > 0 the scale is kept instead: the median stroke (about one symbol) is drawn
    `symbol_size` px long and the image is as tall as the ink needs, up to `height` rows (taller ink is shrunk to
    fit). No image is wider than `max_aspect * height`. Strokes are polylines `line_width` px wide with round ends;
    lone points are dots. A `transform` list gets (lo (2,), scale, offset (2,)): ink point p is drawn at pixel
    (p - lo) * scale + offset.
    """
    box = height - 2 * margin
    if box < 1:
        raise ValueError(f"height {height} leaves no room inside a margin of {margin}")
    traces = [np.asarray(t, dtype=np.float64)[:, :2] for t in traces if len(t)]
    if not traces:
        raise ValueError("no points to draw")
    pts = np.concatenate(traces)
    if not np.isfinite(pts).all():
        raise ValueError("non-finite coordinates")
    lo = pts.min(0)
    ink_w, ink_h = pts.max(0) - lo
    # Treat the ink as at least as tall as its typical stroke is long, so that flat ink (a lone minus, "= -") is
    # drawn at symbol size instead of stretched out; and never exceed the width cap.
    stroke = float(np.median([np.ptp(t, axis=0).max() for t in traces]))
    max_w = max(max_aspect * height - 2 * margin, 1.0)
    extent = max(max(ink_h, stroke) / box, ink_w / max_w)
    if symbol_size > 0 and stroke > 0:
        extent = max(extent, stroke / symbol_size)  # the symbol's own size, unless the ink then does not fit
    scale = 1.0 / extent if extent > 0 else 1.0
    width = int(math.ceil(ink_w * scale)) + 2 * margin + 1
    if symbol_size > 0:
        height = min(height, int(math.ceil(max(ink_h, stroke) * scale)) + 2 * margin + 1)
        box = height - 2 * margin
    y0 = margin + (box - ink_h * scale) / 2  # centre ink that ends up shorter than the box

    if transform is not None:
        transform.append((lo, scale, np.array([margin, y0])))
    img = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(img)
    r = line_width / 2
    for t in traces:
        xy = [(margin + (x - lo[0]) * scale, y0 + (y - lo[1]) * scale) for x, y in t]
        if len(xy) > 1 and np.ptp(t, axis=0).any():
            draw.line(xy, fill=255, width=line_width, joint="curve")
            ends = (xy[0], xy[-1])  # Pillow's line ends are square cut; round them like a pen tip
        else:
            ends = (xy[0],)
        for x, y in ends:
            if r >= 1:
                draw.ellipse((x - r, y - r, x + r, y + r), fill=255)
            else:
                draw.point((x, y), fill=255)
    return np.asarray(img, dtype=np.uint8)


class Raster(NamedTuple):
    """How strokes become pixels (data.scale, data.height, data.symbol_size, data.line_width)."""

    height: int = 64  # scale=height: every image this tall; scale=symbol: the tallest image
    line_width: int = 2
    symbol_size: float = 0.0  # > 0: keep the scale, a typical symbol this many px (scale=symbol)

    @classmethod
    def of(cls, cfg_data) -> "Raster":
        symbol = float(cfg_data.symbol_size) if str(cfg_data.scale) == "symbol" else 0.0
        return cls(int(cfg_data.height), int(cfg_data.line_width), symbol)


class Redraw(NamedTuple):
    """One more drawing of a training file in another hand (data.redraw): which drawing (1, 2, ...; with the file's
    name it seeds the randomness, so a drawing is the same on every machine) and how strong (data.redraw_strength)."""

    index: int
    strength: float = 1.0

    def rng(self, stem: str) -> np.random.Generator:
        digest = hashlib.sha256(f"{stem}/{self.index}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "big"))


def _symbol_groups(root, ids: list) -> list[list[int]]:
    """The traces (indices into `ids`, the traces' ids in document order) of each written symbol: the traceGroups
    that name traces, and each trace in no such group on its own."""
    where = {t: i for i, t in enumerate(ids) if t is not None}
    groups, grouped = [], set()
    for tg in root.iter():
        if _local(tg.tag) != "traceGroup":
            continue
        refs = [c.get("traceDataRef") for c in tg if _local(c.tag) == "traceView"]
        members = [where[r] for r in dict.fromkeys(refs) if r in where and where[r] not in grouped]
        if members:
            groups.append(members)
            grouped.update(members)
    return groups + [[i] for i in range(len(ids)) if i not in grouped]


def redraw_traces(
    traces: list[np.ndarray], groups: list[list[int]], rng: np.random.Generator, strength: float = 1.0
) -> list[np.ndarray]:
    """The expression's strokes as another hand would write them (data.redraw): every symbol (a group of traces)
    scaled (8 %, and 5 % more per axis), turned (4 degrees), moved (5 % of the symbol size) about its own centre,
    and its shape changed by handwriting.distort_glyph (each stroke moved on its own, the symbol bent); then the
    whole expression slanted (shear 0.1) and stretched across (6 %). Every figure is multiplied by `strength`.
    The symbol size is the median over the symbols of their larger side; a longer symbol is turned and bent no more
    at its ends than one of that size."""
    from wapstable.data.handwriting import distort_glyph, jitter_glyph, slant

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


def read_truth(path: Path, root) -> list[str]:
    """The expression's normalised truth tokens, checked against the CROHME 2014 dictionary."""
    # Only the expression's own truth: traceGroups carry per-symbol truth annotations too.
    truth = next(
        (a.text for a in root if _local(a.tag) == "annotation" and a.get("type") == "truth"),
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


def read_inkml(path: str | Path, raster: Raster, redraw: Redraw | None = None) -> Sample:
    """One InkML file as a Sample: id = file stem, image = all traces rasterised, tokens = normalised truth.

    With `redraw`, the strokes as another hand would write them (redraw_traces), the image's scale varied too (its
    symbol size by 10 % times the strength), and the id "STEM~N" for the N-th drawing.
    Raises DataError naming the file (and with a `reason`) for malformed XML, a missing, broken or out-of-dictionary
    truth, or no drawable ink.
    """
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise DataError(f"{path}: not readable InkML ({e})", "malformed XML") from None
    tokens = read_truth(path, root)
    traces, ids = [], []
    for el in root.iter():
        if _local(el.tag) == "trace":
            try:
                traces.append(parse_trace(el.text or ""))
            except ValueError as e:
                raise DataError(
                    f"{path}: trace {el.get('id')!r} is malformed: {e}", "malformed trace"
                ) from None
            ids.append(el.get("id"))
    if not any(len(t) for t in traces):
        raise DataError(f"{path}: no <trace> with points", "no ink")
    stem, symbol_size = path.stem, raster.symbol_size
    if redraw is not None:
        rng = redraw.rng(stem)
        traces = redraw_traces(traces, _symbol_groups(root, ids), rng, redraw.strength)
        symbol_size *= float(np.exp(rng.normal(0, 0.1 * redraw.strength)))
        stem = f"{stem}~{redraw.index}"
    by_id = dict(zip(ids, traces))
    transform = []
    try:
        image = rasterize_traces(
            traces, raster.height, raster.line_width, symbol_size=symbol_size, transform=transform
        )
    except ValueError as e:
        raise DataError(f"{path}: cannot rasterise the traces: {e}", "no ink") from None
    if not image.any():
        raise DataError(f"{path}: the traces draw an empty image", "no ink")
    boxes = symbol_boxes(root, tokens, by_id, transform[0], raster.line_width, image.shape)
    return Sample(stem, image, tokens, boxes)


XML_ID = "{http://www.w3.org/XML/1998/namespace}id"
INKLESS = frozenset({"{", "}", "^", "_", "\\limits"})  # tokens that draw nothing of their own
MATHML_SYMBOLS = ("mi", "mn", "mo", "mtext")  # the elements that hold one written symbol
MATHML_MARKS = (
    "mfrac",
    "msqrt",
)  # a fraction's bar and a root's sign: written before their arguments in LaTeX


def _mathml_order(root) -> list[str]:
    """The xml:ids of the truth MathML's symbols in LaTeX's order: a fraction's bar and a root's sign before their
    arguments, the rest in document order."""
    math = next((a for a in root if _local(a.tag) == "annotationXML" and a.get("type") == "truth"), None)
    out = []

    def visit(el):
        tag = _local(el.tag)
        if (tag in MATHML_SYMBOLS or tag in MATHML_MARKS) and el.get(XML_ID):
            out.append(el.get(XML_ID))
        for child in el:
            visit(child)

    if math is not None:
        visit(math)
    return out


def _inked(tokens: list[str]) -> list[int]:
    """The indices of the tokens that draw a symbol: not braces, scripts' ^ and _, or a root index's [ ]."""
    out, index_depth = [], 0
    for i, tok in enumerate(tokens):
        if tok == "[" and i and tokens[i - 1] == "\\sqrt":
            index_depth = 1
            continue
        if index_depth and tok == "]":
            index_depth = 0
            continue
        if tok not in INKLESS:
            out.append(i)
    return out


def _same_symbol(token: str, truth: str) -> bool:
    if token == "\\frac":
        return truth in ("-", "\\frac", "\\over")
    try:
        return normalize_crohme(tokenize_latex(truth)) == [token]
    except DataError:
        return False


def symbol_boxes(
    root, tokens: list[str], traces: dict, transform, line_width: int, shape
) -> np.ndarray | None:
    """(len(tokens), 4) boxes x0, y0, x1, y1 in the image's pixels of each token's strokes, from the traceGroups
    (each names one symbol's traces and its MathML element), NaN for tokens without ink; None when the symbols do
    not match the tokens one to one (a file without traceGroups, a count or a symbol that differs)."""
    groups = {}
    for tg in root.iter():
        if _local(tg.tag) != "traceGroup":
            continue
        href = next((c.get("href") for c in tg if _local(c.tag) == "annotationXML"), None)
        truth = next((c.text for c in tg if _local(c.tag) == "annotation" and c.get("type") == "truth"), None)
        refs = [c.get("traceDataRef") for c in tg if _local(c.tag) == "traceView"]
        if href and truth and refs:
            groups[href] = (truth.strip(), refs)
    order, inked = _mathml_order(root), _inked(tokens)
    if not groups or len(order) != len(inked):
        return None
    lo, scale, offset = transform
    pad = line_width / 2 + 0.5
    h, w = shape
    boxes = no_boxes(len(tokens))
    for i, ref in zip(inked, order):
        if ref not in groups or not _same_symbol(tokens[i], groups[ref][0]):
            return None
        pts = [traces[t] for t in groups[ref][1] if t in traces and len(traces[t])]
        if not pts:
            return None
        px = (np.concatenate(pts)[:, :2] - lo) * scale + offset
        x0, y0 = px.min(0) - pad
        x1, y1 = px.max(0) + pad
        boxes[i] = (max(0.0, x0), max(0.0, y0), min(float(w), x1), min(float(h), y1))
    return boxes


class FolderRead(NamedTuple):
    """A folder of InkML: its samples, one (reason, message) per file that could not be used, and its file count."""

    samples: list[Sample]
    errors: list[tuple[str, str]]
    total: int

    def reasons(self) -> dict[str, int]:
        return dict(Counter(reason for reason, _ in self.errors))


# The modules whose code turns a file into a sample (the reader, the label normaliser, the rasteriser, data.redraw's
# strokes, the file's layout): a change to them reads every folder again by itself (cache.code_hash).
READING_CODE = (
    "wapstable.data.crohme",
    "wapstable.data.latex",
    "wapstable.data.handwriting",
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


def held_out(tokens: Sequence[str], fraction: float) -> bool:
    """Whether an expression belongs to the validation split: a hash of its normalised label, so every file of one
    expression falls on the same side, the same way on every machine."""
    digest = hashlib.sha256(" ".join(tokens).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


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


def crohme_splits(cfg_data, which: Sequence[str]):
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
