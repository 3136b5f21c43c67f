"""A folder of images with a captions file (data=images): CoMER's data.zip, HME100K, or your own scans.

Each split is a folder part `P` under data.root, in one of the layouts users have:

- CoMER (`data.zip`): `P/img/KEY.bmp` with `P/caption.txt`;
- HME100K: `P_images/KEY.jpg` with `P_labels.txt`;
- the WAP authors' bitmaps: `P/KEY_0.bmp` with `P_caption.txt` (`off_image_test/` with `test_caption.txt` is
  data.test=off_image_test after renaming the captions file, or any folder beside a `P_caption.txt`).

A captions line is `KEY<TAB>label`: the label is LaTeX, spaced into tokens or not (`x ^ { 2 }` or `x^2`); KEY is
the image's name with or without its extension (png, jpg, bmp; grey or colour). With data.symbols=crohme every
label is normalised into the CROHME 2014 dictionary as data=crohme's are; otherwise the tokens are kept and the
vocabulary is built from the data. Images are stored with their ink bright on black (any polarity is read), and
data.normalize (on by default) brings them to the model's ink. Each folder is read once, with a progress bar, and
cached under `data.cache_dir/images/`; an unreadable image or label is skipped and counted (data.on_error=skip)
or stops the run with one sentence.
"""

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from wapstable.data.cache import check_writable, code_hash, pack_images, read_npz, unpack_images, write_npz
from wapstable.data.latex import DataError, check_on_error, normalize_crohme, on_data_error, tokenize_latex
from wapstable.data.normalize import normalize, read_image
from wapstable.data.sample import Sample, Splits, data_root, held_out
from wapstable.data.sources.base import DataSource
from wapstable.errors import UserError

log = logging.getLogger(__name__)

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp")
CACHE_FORMAT = 1
# The modules whose code turns a caption line and its image into a sample: a change to them reads every folder again
# by itself (cache.code_hash).
READING_CODE = (
    "wapstable.data.sources.images",
    "wapstable.data.normalize",
    "wapstable.data.latex",
    "wapstable.data.cache",
)


def find_layout(root: Path, part: str) -> tuple[Path, Path]:
    """(captions file, images folder) of split folder `part` under `root`, in the first layout that is there."""
    layouts = [
        (root / part / "caption.txt", root / part / "img"),  # CoMER
        (root / f"{part}_labels.txt", root / f"{part}_images"),  # HME100K
        (root / f"{part}_caption.txt", root / part),  # the WAP authors' bitmaps
    ]
    for captions, images in layouts:
        if captions.is_file() and images.is_dir():
            return captions, images
    tried = "; ".join(f"{c.relative_to(root)} with {i.relative_to(root)}/" for c, i in layouts)
    raise DataError(
        f"data=images finds no captions file and image folder for {part!r} under {root} (looked for {tried}); "
        "set data.root and data.train / data.test_sets to split folders in one of these layouts"
    )


def read_label(label: str, crohme: bool) -> list[str]:
    """A caption's tokens, normalised into the CROHME dictionary when `crohme` (DataError when it does not parse)."""
    tokens = tokenize_latex(label)
    if crohme:
        tokens = normalize_crohme(tokens)
    if not tokens:
        raise DataError("the label has no tokens", "empty label")
    return tokens


def read_picture(path: Path) -> np.ndarray:
    """An image file as (H, W) uint8 with its ink bright on black, or DataError naming the file."""
    try:
        gray = read_image(path)
    except UserError as e:
        raise DataError(str(e), "unreadable image") from None
    image = normalize(gray, None)  # polarity and contrast only: data.normalize does the scale and pen
    if not image.any():
        raise DataError(f"{path}: the image has no ink", "no ink")
    return image


def _key(captions: Path, files: list[Path], crohme: bool) -> str:
    listing = [(f.name, st.st_size, st.st_mtime_ns) for f in [captions, *files] for st in [f.stat()]]
    blob = json.dumps([CACHE_FORMAT, code_hash(*READING_CODE), crohme, str(captions.resolve()), listing])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _load_part(z) -> tuple[list[Sample], list[tuple[str, str]], int]:
    """read_part's answer from an open cache file `z`; ValueError when its arrays disagree."""
    meta = json.loads(str(z["meta"]))
    ids, labels, images = z["ids"], z["tokens"], unpack_images(z["shapes"], z["pixels"])
    if not len(ids) == len(labels) == len(images):
        raise ValueError("the arrays do not agree")
    samples = [Sample(str(i), im, str(t).split(" ")) for i, t, im in zip(ids, labels, images)]
    return samples, [tuple(e) for e in meta["errors"]], int(meta["total"])


def read_part(
    root: Path, part: str, crohme: bool, cache_dir
) -> tuple[list[Sample], list[tuple[str, str]], int]:
    """The samples of one split folder, the (reason, message) of each line that could not be used, and the count
    of caption lines; cached under `cache_dir/images/` when given."""
    captions, folder = find_layout(root, part)
    files = sorted(f for f in folder.iterdir() if f.suffix.lower() in EXTENSIONS)
    cache = None
    if cache_dir:
        cache = Path(cache_dir).expanduser() / "images" / _key(captions, files, crohme) / f"{part}.npz"
        cached = read_npz(cache, _load_part, f"reading {folder} again")
        if cached is not None:
            log.info("loaded %d images of %s from %s", len(cached[0]), part, cache)
            return cached
        check_writable(cache.parent)  # before the reading, not after
    by_name = {f.name: f for f in files}
    by_stem = {}
    for f in files:
        by_stem.setdefault(f.stem, f)
        if f.stem.endswith("_0"):  # the WAP authors' KEY_0.bmp
            by_stem.setdefault(f.stem[:-2], f)
    from tqdm import tqdm

    samples, errors, seen = [], [], set()
    lines = [ln for ln in captions.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    for n, line in enumerate(tqdm(lines, desc=f"reading {part}", unit="image", mininterval=2), 1):
        key, _, label = line.partition("\t") if "\t" in line else line.strip().partition(" ")
        key = key.strip()
        where = f"{captions}:{n}"
        try:
            path = by_name.get(key) or by_stem.get(key) or by_stem.get(Path(key).stem)
            if path is None:
                raise DataError(f"{where}: {key!r} has no image in {folder}", "no image")
            if key in seen:
                raise DataError(f"{where}: {key!r} has a second caption line", "duplicate key")
            try:
                tokens = read_label(label, crohme)
            except DataError as e:
                raise DataError(f"{where}: the label of {key!r} is unusable ({e})", e.reason) from None
            samples.append(Sample(Path(key).stem if key in by_name else key, read_picture(path), tokens))
            seen.add(key)
        except DataError as e:
            errors.append((e.reason, str(e)))
    if cache is not None:
        shapes, pixels = pack_images([s.image for s in samples])
        arrays = {
            "ids": np.array([s.id for s in samples], dtype=str),
            "tokens": np.array([" ".join(s.tokens) for s in samples], dtype=str),
            "shapes": shapes,
            "pixels": pixels,
            "meta": np.array(json.dumps({"errors": errors, "total": len(lines)})),
        }
        write_npz(cache, arrays)
    return samples, errors, len(lines)


def image_splits(cfg_data, which) -> Splits:
    """The splits of data=images under data.root (see the module docstring), with a report of what was skipped."""
    d = cfg_data
    root = data_root(d)
    check_on_error(d.on_error)
    crohme = str(d.symbols) == "crohme"
    if not 0 <= d.valid_fraction < 1:
        raise UserError(f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    if not d.valid and d.valid_fraction <= 0:
        raise UserError(
            "data.valid is empty and data.valid_fraction=0: give a validation folder or a fraction > 0"
        )
    splits = Splits()

    def read(part: str, label: str) -> list[Sample]:
        samples, errors, total = read_part(root, str(part), crohme, d.cache_dir)
        for reason, message in errors:
            on_data_error(message, d.on_error, [], log, reason)
        splits.report["skipped"][label] = dict(Counter(reason for reason, _ in errors))
        splits.report["files"][label] = total
        splits.report["skipped_files"][label] = [message for _, message in errors]
        return samples

    if "train" in which or ("valid" in which and not d.valid):
        train = read(d.train, "train")
        if not d.valid:
            sides = {False: [], True: []}
            for s in train:
                sides[held_out(s.tokens, d.valid_fraction)].append(s)
            train = sides[False]
            if "valid" in which:
                splits["valid"] = sides[True]
            log.info(
                "validation: %d of %d training images held out by label",
                len(sides[True]),
                len(train) + len(sides[True]),
            )
        if "train" in which:
            splits["train"] = train
    if "valid" in which and d.valid:
        splits["valid"] = read(d.valid, "valid")
    if "test" in which:
        sets = dict(d.test_sets) if d.test_sets else {"test": d.test}
        test = []
        for name, part in sets.items():
            samples = read(part, f"test {name}")
            splits.report["test_sets"][str(name)] = splits.report["files"][f"test {name}"]
            prefix = f"{name}/" if d.test_sets else ""
            test += [s._replace(id=prefix + s.id) for s in samples]
        splits["test"] = test
    for split, samples in splits.items():
        if not samples:
            raise UserError(
                f"the {split} split of data=images under {root} is empty; check data.root and data.{split}"
            )
    return splits


class ImageSource(DataSource):
    """`data=images`: a folder of images with a captions file (CoMER's, HME100K's or the WAP authors' layout)."""

    name = "images"

    def splits(self, cfg_data, which: Sequence[str]) -> Splits:
        return image_splits(cfg_data, which)
