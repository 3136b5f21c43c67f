"""The original WAP data format (data=wap_pkl): a pickled {key: uint8 [C,H,W]} per split and a caption file.

Caption lines are `key<TAB>tok tok tok` (split on any whitespace, as WAP's own reader does); the dictionary is
a `tok<TAB>index` file read with Vocab.load. Split `P` is `offline-P.pkl` with `P_caption.txt` under data.root.
"""

import gzip
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from wapstable.data.latex import DataError, check_on_error, on_data_error
from wapstable.data.sample import Sample, data_root
from wapstable.data.sources.base import DataSource
from wapstable.errors import UserError

log = logging.getLogger(__name__)


def _read_pickle(path: Path) -> dict:
    if not path.is_file():
        raise DataError(
            f"the WAP image pickle {path} does not exist; set data.root and data.train/valid/test"
        )
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"  # some ports gzip their pickles
        with (gzip.open if gzipped else open)(path, "rb") as f:
            # latin1 reads the numpy arrays of WAP's original Python 2 pickles; harmless for Python 3 ones
            data = pickle.load(f, encoding="latin1")
    except (
        Exception
    ) as e:  # a truncated or foreign pickle fails in many ways (EOFError, UnpicklingError, ...)
        raise DataError(f"the WAP image pickle {path} cannot be loaded ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise DataError(f"the WAP image pickle {path} holds a {type(data).__name__}, not a dict of images")
    return data


def _read_captions(path: Path, on_error: str, errors: list[str]) -> tuple[dict[str, list[str]], set[str]]:
    """Captions by key, and the keys of lines that were skipped as malformed."""
    if not path.is_file():
        raise DataError(
            f"the WAP caption file {path} does not exist; set data.root and data.train/valid/test"
        )
    captions: dict[str, list[str]] = {}
    bad: set[str] = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        key, *tokens = line.split()
        if not tokens:
            bad.add(key)
            on_data_error(f"{path}:{n}: caption line for {key!r} has no tokens", on_error, errors, log)
        elif key in captions:
            on_data_error(f"{path}:{n}: key {key!r} has a second caption line", on_error, errors, log)
        else:
            captions[key] = tokens
    return captions, bad


def _as_image(value: object) -> np.ndarray | str:
    """The (H, W) uint8 image stored under one key, or why it is unusable."""
    if not isinstance(value, np.ndarray):
        return f"is a {type(value).__name__}, not a numpy array"
    a = value
    if a.ndim == 3:
        a = a[0]  # WAP stores [C, H, W] with C = 1
    if a.ndim != 2:
        return f"has shape {value.shape}, expected [C, H, W] or [H, W]"
    if a.size == 0:
        return f"is empty (shape {value.shape})"
    if a.dtype != np.uint8:
        if a.dtype == bool:
            a = a.astype(np.uint8) * 255
        elif np.issubdtype(a.dtype, np.number) and np.isfinite(a).all() and a.min() >= 0 and a.max() <= 255:
            a = np.rint(a).astype(np.uint8)
        else:
            return f"has dtype {a.dtype} with values outside 0..255"
    if not a.any():
        return "is blank (all zero)"
    return np.ascontiguousarray(a)


def load_wap_split(
    images_pkl: str | Path, captions_txt: str | Path, on_error: str
) -> tuple[list[Sample], list[str]]:
    """Samples in caption-file order from a WAP pickle and caption file, and the messages of skipped entries.

    Reported by key: captions without an image, images without a caption, empty or malformed images, caption
    lines without tokens or repeated. on_error="fail" raises DataError at the first; "skip" logs and drops.
    A missing, truncated or corrupt file always raises.

    Loading a pickle can run arbitrary code: only read pickles from a source you trust. (It is the format
    WAP's data ships in; write_wap_split converts other data to it.)
    """
    check_on_error(on_error)
    images_pkl, captions_txt = Path(images_pkl), Path(captions_txt)
    images = _read_pickle(images_pkl)
    errors: list[str] = []
    captions, bad = _read_captions(captions_txt, on_error, errors)
    # Python 2 pickles may hold bytes keys; captions are text
    images = {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in images.items()}

    samples = []
    for key, tokens in captions.items():
        if key not in images:
            on_data_error(
                f"{captions_txt}: {key!r} has a caption but no image in {images_pkl}", on_error, errors
            )
            continue
        image = _as_image(images[key])
        if isinstance(image, str):
            on_data_error(f"{images_pkl}: the image of {key!r} {image}", on_error, errors)
            continue
        samples.append(Sample(key, image, tokens))
    for key in sorted(images.keys() - captions.keys() - bad):  # bad lines are reported already
        on_data_error(
            f"{images_pkl}: {key!r} has an image but no caption in {captions_txt}", on_error, errors
        )
    return samples, errors


def write_wap_split(samples: list[Sample], images_pkl: str | Path, captions_txt: str | Path) -> None:
    """Write samples in WAP's format: a pickle of {id: uint8 [1, H, W]} and `id<TAB>tokens` caption lines."""
    images = {}
    lines = []
    for s in samples:
        if not s.tokens or any(not t or any(c.isspace() for c in t) for t in s.tokens):
            raise ValueError(
                f"sample {s.id!r}: WAP captions need at least one token and no whitespace in tokens"
            )
        if not s.id or any(c.isspace() for c in s.id) or s.id in images:
            raise ValueError(f"sample id {s.id!r} is empty, has whitespace or is repeated")
        images[s.id] = np.asarray(s.image, dtype=np.uint8)[None]
        lines.append(f"{s.id}\t{' '.join(s.tokens)}\n")
    with open(images_pkl, "wb") as f:
        pickle.dump(images, f, protocol=pickle.HIGHEST_PROTOCOL)
    Path(captions_txt).write_text("".join(lines), encoding="utf-8")


def wap_pkl_splits(cfg_data, which: Sequence[str]) -> dict[str, list[Sample]]:
    """The splits `which` of data=wap_pkl under data.root: a file that cannot be read is one sentence (UserError),
    and an empty split names its key."""
    root = data_root(cfg_data)
    splits, errors = {}, []
    for split in which:
        part = getattr(cfg_data, split)
        try:
            samples, errs = load_wap_split(
                root / f"offline-{part}.pkl", root / f"{part}_caption.txt", cfg_data.on_error
            )
        except (ValueError, OSError) as e:
            if isinstance(e, UserError):
                raise
            raise UserError(str(e)) from None
        splits[split], errors = samples, errors + errs
    if errors:
        log.warning("skipped %d bad files or samples (data.on_error=skip)", len(errors))
    for split, samples in splits.items():
        if not samples:
            raise UserError(
                f"the {split} split of data=wap_pkl under {root} is empty; check data.root and data.{split}"
            )
    return splits


class WapPklSource(DataSource):
    """`data=wap_pkl`: the WAP authors' pickles of offline images, their captions and dictionary."""

    name = "wap_pkl"

    def splits(self, cfg_data, which: Sequence[str]) -> dict[str, list[Sample]]:
        return wap_pkl_splits(cfg_data, which)
