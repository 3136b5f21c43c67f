"""The data source data=synthetic: random LaTeX expressions (render.grammar) drawn by the project, printed with
mathtext (render.mathtext) or as handwriting (render.handwritten), with every token's box.

Everything random is drawn from numpy Generators seeded by (seed, split, index), so a config gives bit-identical data
however many worker processes render it. The splits are rendered once and cached as an .npz under
`cache_dir/synthetic/<hash of the parameters>/`, the parameters holding every data key that changes the pixels and
the hash of the code that draws them (DRAWING_CODE). The checks of the data keys come first, so that a bad value is
one sentence naming its key before any work.
"""

import hashlib
import importlib.metadata
import json
import logging
import math
import multiprocessing as mp
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import matplotlib
import numpy as np
import torch

from wapstable.data.cache import check_writable, code_hash, pack_images, read_npz, unpack_images, write_npz
from wapstable.data.ink.raster import Raster
from wapstable.data.render.grammar import LABEL_STREAM, RENDER_STREAM, seeded_rng, unique_expressions
from wapstable.data.render.handwritten import render_handwritten
from wapstable.data.render.mathtext import FONTS, collect_boxes, font_properties, render
from wapstable.data.sample import Sample, Splits, no_boxes
from wapstable.data.sources.base import DataSource
from wapstable.errors import UserError

log = logging.getLogger(__name__)

# The code that draws the splits (the grammar, mathtext's and the stroke fonts' renderers: the render package; the
# raster; the tokens without ink; this file's layout): a change to any of its modules renders the splits again by
# itself (cache.code_hash). The version numbers below date from before the hash; bumping them still renders again.
DRAWING_CODE = (
    "wapstable.data.sources.synthetic",
    "wapstable.data.render",
    "wapstable.data.ink.raster",
    "wapstable.data.latex",
    "wapstable.data.cache",
)
# 2: each sample's symbol boxes are cached beside its pixels (the pixels are those of version 1)
FORMAT_VERSION = 2
# data.style=handwritten's strokes (2: roots drawn in every font set)
HANDWRITING_VERSION = 2
SPLITS = ("train", "valid", "test")
# data.jitter, data.distort, data.allographs, data.script_place, data.font_mix, data.spacing and data.size_jitter at
# their defaults (data.schema.SyntheticData): a handwritten glyph as its expression's font has drawn it, where
# mathtext put it, at data.symbol_size
GLYPH_STRAYING = {
    "jitter": 1.0,
    "distort": 0.0,
    "allographs": 0.0,
    "script_place": 0.0,
    "font_mix": 0.0,
    "spacing": 0.0,
    "size_jitter": 0.0,
    "more_forms": 0.0,
}
# the keys of GLYPH_STRAYING that are chances, with what 0 and 1 draw (for the refusal of a value over 1)
GLYPH_CHANCES = {
    "allographs": ("the fonts' glyphs only", "the other hand-written forms wherever a symbol has them"),
    "script_place": ("every script where mathtext puts it", "every script where writers put it"),
    "font_mix": ("each expression in one stroke font", "a stroke font drawn for every glyph"),
    "more_forms": ("those symbols as the fonts draw them", "every one of them in one of its other forms"),
}


class RenderJob(NamedTuple):
    """One worker's share of the rendering: labels `start`, `start + 1`, ... of one split, and how to draw them."""

    split_code: int  # the split's index in SPLITS: part of every image's random stream
    start: int
    labels: list[list[str]]
    fonts: list[str]
    font_size: int
    augment: bool
    seed: int
    raster: Raster | None  # data.style=handwritten; None draws print
    bank_file: str | None  # data.glyphs=crohme: the cached bank of real symbols
    straying: dict[str, float]  # render_handwritten's keys of GLYPH_STRAYING


def _render_chunk(job: RenderJob) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """(image, token boxes) of each label of the job, and how many layouts did not match their tokens."""
    out = []
    unmatched = 0  # handwritten layouts that did not match their tokens (render() counts its own in the sink)
    bank = None
    if job.bank_file is not None:
        from wapstable.data.ink.bank import load_bank

        bank = load_bank(job.bank_file)
    # without data.augment every glyph is drawn as it is laid out: jitter and the rest at 0
    shaping = job.straying if job.augment else dict.fromkeys(job.straying, 0.0)
    with collect_boxes() as sink:
        for i, tokens in enumerate(job.labels, job.start):
            rng = seeded_rng(job.seed, RENDER_STREAM, job.split_code, i)
            font = job.fonts[int(rng.integers(len(job.fonts)))]
            if job.raster is not None:  # data.style=handwritten
                image, boxes = render_handwritten(
                    tokens, font, job.font_size, rng, job.raster, bank=bank, **shaping
                )
                unmatched += bool(np.isnan(boxes).all())
                out.append((image, boxes))
                continue
            image = render(tokens, font, job.font_size, rng, job.augment)
            out.append((image, sink.pop() if sink else no_boxes(len(tokens))))
    return out, sink.failures + unmatched


def _worker_init() -> None:
    # one intra-op thread: the tensors are tiny, and libgomp is not safe to use with many threads after a fork
    torch.set_num_threads(1)


@contextmanager
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _render_all(labels: dict[str, list[list[str]]], cfg, params: dict) -> dict[str, list[tuple]]:
    total = sum(len(v) for v in labels.values())
    workers = int(cfg.render_workers or 0)
    raster = bank_file = None
    if params.get("style") == "handwritten":
        raster = Raster.of(cfg)
    if params.get("glyphs") == "crohme":
        from wapstable.data.ink.bank import cache_file, load_bank

        bank_file = str(cache_file(cfg.cache_dir, params["glyph_bank"]))  # cache_params built it
        load_bank(bank_file)  # once here: the render workers fork with it
    chunk = max(1, min(256, math.ceil(total / max(1, 4 * workers))))
    jobs, owners = [], []
    for code, split in enumerate(SPLITS):
        for start in range(0, len(labels[split]), chunk):
            batch = labels[split][start : start + chunk]
            jobs.append(
                RenderJob(
                    code,
                    start,
                    batch,
                    params["fonts"],
                    params["font_size"],
                    params["augment"],
                    params["seed"],
                    raster,
                    bank_file,
                    {name: params.get(name, default) for name, default in GLYPH_STRAYING.items()},
                )
            )
            owners.append(split)
    t0 = time.perf_counter()
    if workers <= 1 or len(jobs) <= 1:
        with _single_thread():
            results = [_render_chunk(job) for job in jobs]
    else:
        method = "fork" if "fork" in mp.get_all_start_methods() else None
        with mp.get_context(method).Pool(min(workers, len(jobs)), initializer=_worker_init) as pool:
            results = pool.map(_render_chunk, jobs, chunksize=1)
    dt = time.perf_counter() - t0
    log.info("rendered %d images in %.1f s (%.0f images/s)", total, dt, total / max(dt, 1e-9))
    failures = sum(n for _, n in results)
    if failures:
        log.warning(
            "%d of %d layouts did not match their tokens: those images have no symbol boxes", failures, total
        )
    images = {split: [] for split in SPLITS}
    for split, (rendered, _) in zip(owners, results):
        images[split] += rendered
    return images


def cache_params(cfg) -> dict:
    _check_glyphs(cfg)
    fonts = [str(f) for f in cfg.fonts]
    if not fonts:
        raise UserError(f"data.fonts must name at least one mathtext font set of {list(FONTS)}")
    for font in fonts:
        try:
            font_properties(font, int(cfg.font_size))  # an unknown font set fails here, not in a worker
        except ValueError as e:
            raise UserError(f"data.fonts: {e}") from None
    if _key(cfg, "frequencies") != "grammar" and _key(cfg, "symbols") != "crohme":
        raise UserError(
            f"data.frequencies={_key(cfg, 'frequencies')} weighs the symbols of the CROHME dictionary; "
            "set data.symbols=crohme with it, or data.frequencies=grammar"
        )
    if min(cfg.num_train, cfg.num_valid, cfg.num_test) < 0:
        raise UserError("data.num_train, num_valid and num_test must not be negative")
    return dict(
        format=FORMAT_VERSION,
        num_train=int(cfg.num_train),
        num_valid=int(cfg.num_valid),
        num_test=int(cfg.num_test),
        difficulty=int(cfg.difficulty),
        fonts=fonts,
        font_size=int(cfg.font_size),
        augment=bool(cfg.augment),
        seed=int(cfg.seed),
        # a new renderer or random stream may draw other pixels for the same config
        matplotlib=matplotlib.__version__,
        torch=torch.__version__,
        torchvision=importlib.metadata.version("torchvision"),
        numpy=np.__version__,
        code=code_hash(*DRAWING_CODE),
        # only when not the default, so that the caches of default configs stay valid
        **({"symbols": _key(cfg, "symbols")} if _key(cfg, "symbols") != "base" else {}),
        **({"frequencies": _key(cfg, "frequencies")} if _key(cfg, "frequencies") != "grammar" else {}),
        **(_handwriting_params(cfg) if _key(cfg, "style") == "handwritten" else {}),
    )


def _key(cfg, name: str) -> str:
    """A data key that selects what is drawn, as a string; a config from before it existed has its default."""
    return str(
        getattr(
            cfg,
            name,
            {"symbols": "base", "style": "printed", "glyphs": "fonts", "frequencies": "grammar"}[name],
        )
    )


def _check_glyphs(cfg) -> None:
    if _key(cfg, "glyphs") != "fonts" and _key(cfg, "style") != "handwritten":
        raise UserError(f"data.glyphs={cfg.glyphs} draws handwriting: set data.style=handwritten as well")
    if _key(cfg, "style") != "handwritten":
        for name in straying(cfg):  # only the keys not at their defaults
            raise UserError(
                f"data.{name}={getattr(cfg, name)} shapes handwritten glyphs: set data.style=handwritten as well"
            )


def straying(cfg) -> dict[str, float]:
    """data.jitter, data.distort, data.allographs, data.script_place, data.font_mix, data.spacing, data.size_jitter
    and data.more_forms where they are not at their defaults (GLYPH_STRAYING); a config from before they existed has the defaults. A
    negative or NaN value is refused, a chance (data.allographs, data.script_place, data.font_mix,
    data.more_forms) over 1, and
    data.size_jitter over 1 (a spread of e times the size either way, nothing a writer does)."""
    values = {name: float(getattr(cfg, name, default)) for name, default in GLYPH_STRAYING.items()}
    for name, v in values.items():
        if not v >= 0:  # NaN too
            raise UserError(
                f"data.{name}={v} must be >= 0 (data.jitter=1 is the usual jitter of each glyph, data.distort=0 "
                "leaves its shape alone, data.allographs=0 draws every glyph as the fonts do, data.script_place=0 "
                "leaves every script where mathtext puts it, data.font_mix=0 draws an expression in one font, "
                "data.spacing=0 keeps mathtext's spacing, data.size_jitter=0 draws every expression at "
                "data.symbol_size, data.more_forms=0 draws the symbols of MORE_FORMS as the fonts do)"
            )
    for name, (zero, one) in GLYPH_CHANCES.items():
        if values[name] > 1:
            raise UserError(
                f"data.{name}={values[name]} is a chance: set it between 0 ({zero}) and 1 ({one})"
            )
    if values["size_jitter"] > 1:
        raise UserError(
            f"data.size_jitter={values['size_jitter']} is a spread of sizes on a log scale: set it between 0 (every "
            "expression at data.symbol_size) and 1 (0.2 spreads them as CROHME writers' sizes spread)"
        )
    return {name: v for name, v in values.items() if v != GLYPH_STRAYING[name]}


def _handwriting_params(cfg) -> dict:

    if int(cfg.line_width) < 1 or int(cfg.height) < 16:
        raise UserError(
            f"data.style=handwritten needs data.line_width >= 1 and data.height >= 16, got {cfg.line_width} and "
            f"{cfg.height}"
        )
    out = dict(
        style="handwritten",
        handwriting=HANDWRITING_VERSION,
        raster=list(Raster.of(cfg)),
        hershey=importlib.metadata.version("hershey-fonts"),
        pillow=importlib.metadata.version("pillow"),
    )
    out.update(straying(cfg))  # only when not the default, so that the caches of default configs stay valid
    if "size_jitter" in out and str(cfg.scale) != "symbol":
        raise UserError(
            f"data.size_jitter={cfg.size_jitter} spreads the size symbols are drawn at, which data.scale={cfg.scale} "
            "does not keep: set data.scale=symbol as well (or data.size_jitter=0)"
        )
    if _key(cfg, "glyphs") == "crohme":  # real symbols: the bank's key names the files they were cut from
        out["glyphs"] = "crohme"
        out["glyph_bank"] = _bank_path(cfg).parent.name
    return out


def _bank_path(cfg) -> Path:
    """data.glyphs=crohme: the cached bank of symbols cut from data.root/data.train (built on first use)."""
    from wapstable.data.ink.bank import bank_path  # its DataError is a UserError: one sentence

    if not cfg.root:
        raise UserError(
            "data.glyphs=crohme cuts real symbols from the CROHME training files: set data.root to the "
            "CROHME_labeled_2016 folder"
        )
    return bank_path(Path(cfg.root).expanduser() / cfg.train, float(cfg.valid_fraction), cfg.cache_dir)


def _save(path: Path, splits: dict[str, list[Sample]], params: dict) -> None:
    arrays = {"params": np.array(json.dumps(params, sort_keys=True))}
    for split, samples in splits.items():
        arrays[f"{split}_shapes"], arrays[f"{split}_pixels"] = pack_images([s.image for s in samples])
        arrays[f"{split}_tokens"] = np.array([" ".join(s.tokens) for s in samples], dtype=str)
        # one row per token of every label in turn: x0, y0, x1, y1 in pixels, NaN for a token without ink
        boxes = [s.boxes if s.boxes is not None else no_boxes(len(s.tokens)) for s in samples]
        arrays[f"{split}_boxes"] = np.concatenate(boxes) if boxes else no_boxes(0)
    write_npz(path, arrays, compress=True)


def _load(z, params: dict) -> dict[str, list[Sample]]:
    """The splits of an open cache file `z`; ValueError when it holds other parameters or its arrays disagree."""
    if json.loads(str(z["params"])) != params:
        raise ValueError("the cached parameters differ from the config")
    splits = {}
    for split in SPLITS:
        shapes, pixels, labels = z[f"{split}_shapes"], z[f"{split}_pixels"], z[f"{split}_tokens"]
        if len(shapes) != params[f"num_{split}"] or len(labels) != len(shapes):
            raise ValueError(f"{split} holds {len(shapes)} samples, expected {params[f'num_{split}']}")
        images = unpack_images(shapes, pixels)
        tokens = [str(label).split(" ") for label in labels]
        boxes = z[f"{split}_boxes"]
        ends = np.cumsum([len(t) for t in tokens], dtype=np.int64)
        if boxes.shape != (int(ends[-1]) if len(ends) else 0, 4):
            raise ValueError(f"{split} holds {len(boxes)} token boxes for {ends[-1]} tokens")
        splits[split] = [
            Sample(f"{split}-{i:06d}", image, t, boxes[end - len(t) : end])
            for i, (image, t, end) in enumerate(zip(images, tokens, ends))
        ]
    return splits


def cache_path(cache_dir, params: dict) -> Path:
    """The cache file of the splits of `params` (cache_params) under `cache_dir`: named by their hash."""
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "synthetic" / key / "splits.npz"


def build_splits(cfg) -> dict[str, list[Sample]]:
    """Render (or load from the cache) the synthetic train/valid/test splits described by `cfg`.

    No expression appears in two splits. Test is drawn first, then valid, then train, each from its own stream,
    so growing num_train leaves valid and test unchanged.
    """
    params = cache_params(cfg)
    path = cache_path(cfg.cache_dir, params)
    splits = read_npz(path, lambda z: _load(z, params), "rendering it again")
    if splits is not None:
        log.info("loaded synthetic splits from %s", path)
        return splits
    check_writable(path.parent)  # before the render, not after
    labels, taken = {}, frozenset()
    for code, split in reversed(list(enumerate(SPLITS))):
        rng = seeded_rng(params["seed"], LABEL_STREAM, code)
        labels[split] = unique_expressions(
            params[f"num_{split}"],
            rng,
            params["difficulty"],
            taken,
            params.get("symbols", "base"),
            params.get("frequencies", "grammar"),
        )
        taken = taken | {" ".join(t) for t in labels[split]}
    images = _render_all(labels, cfg, params)
    splits = {
        split: [
            Sample(f"{split}-{i:06d}", im, t, boxes)
            for i, ((im, boxes), t) in enumerate(zip(images[split], labels[split]))
        ]
        for split in SPLITS
    }
    _save(path, splits, params)
    return splits


def synthetic_splits(cfg_data, which: Sequence[str]) -> Splits:
    """The splits `which` of data=synthetic (build_splits); with data.root and data.test_sets, the test split is the
    named CROHME test sets, read as data=crohme reads them (the same raster settings), each reported on its own."""
    for split in which:
        if getattr(cfg_data, f"num_{split}") <= 0:
            raise UserError(
                f"data.num_{split}={getattr(cfg_data, f'num_{split}')} leaves the synthetic {split} split "
                f"empty; set data.num_{split} to a positive number"
            )
    splits = Splits({split: samples for split, samples in build_splits(cfg_data).items() if split in which})
    if "test" in which and getattr(cfg_data, "root", None) and getattr(cfg_data, "test_sets", None):
        from wapstable.data.sources.crohme import crohme_splits

        real = crohme_splits(cfg_data, ["test"])
        splits["test"] = real["test"]
        splits.report = real.report
    return splits


class SyntheticSource(DataSource):
    """`data=synthetic` (the default): expressions the project renders itself, printed or handwritten, with the
    symbol box of every token."""

    name = "synthetic"
    boxes = True

    def splits(self, cfg_data, which: Sequence[str]) -> Splits:
        return synthetic_splits(cfg_data, which)
