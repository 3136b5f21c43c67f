"""The data config's schema: the keys every source shares (`DataConfig`, with `data.batch` and `data.pixel_aug`),
and the built-in sources' own keys, each source's in a subclass of it (`SyntheticData`: data=synthetic's rendering;
`CrohmeData`: data=crohme's redrawing).

`conf/data/NAME.yaml` names its source's schema first in its defaults (`/schema/data/NAME@_here_`, stored by
`wapstable.config.register_configs`), so `data.style=handwritten` is typed and checked when the config is composed,
and a key another source owns is refused there (`data=crohme data.num_train=5`: "Key 'num_train' not in
'CrohmeData'"). The schemas are kept here, apart from the sources' modules, so that composing a config does not
import the rendering code. A source of one's own keeps its keys in `data.options`, typed by its `Options`
(docs/extending.md).
"""

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

# Keys with a fixed set of values. OmegaConf checks them when a config is composed, loaded from a checkpoint or
# overridden (`Invalid value 'x', expected one of [...]`, naming the key), so no module checks them again. A value
# reads as the plain string: `cfg.data.on_error == "skip"`, and checkpoints store strings (`enum_to_str=True`).
OnError = StrEnum("OnError", "fail skip")
InkScale = StrEnum("InkScale", "height symbol")
InkStyle = StrEnum("InkStyle", "printed handwritten")
SymbolSet = StrEnum("SymbolSet", "base crohme")
Frequencies = StrEnum("Frequencies", "grammar crohme")
GlyphSource = StrEnum("GlyphSource", "fonts crohme")
BucketBy = StrEnum("BucketBy", "size tokens")


@dataclass
class PixelAugConfig:
    # A fresh augmentation of every training batch (wapstable/data/pixel_aug.py): the batch drawn `scale` [lo, hi]
    # times as large (log-uniform; [1, 1] = off; CoMER: [0.7, 1.4]), and the chance that an image's pen is made
    # one px thinner or one or two thicker, that it is blurred, that it is binarised at a random level
    scale: list[float] = field(default_factory=lambda: [1.0, 1.0])
    pen: float = 0.0
    blur: float = 0.0
    binarize: float = 0.0


@dataclass
class ReadRangeConfig:
    # The symbol sizes a checkpoint records as read well (its `ink_stats.symbol_range`: data.normalize keeps an image
    # inside it as it is and resamples one outside it). At the end of training the best model reads the validation
    # split greedily at scale 1 and at each of `scales`; the range runs from the smallest to the largest factor,
    # reached from 1 without one that reads more than `tolerance` points below scale 1, times the training images'
    # quartiles. Empty `scales`: the range the model was shown (the quartiles times data.pixel_aug.scale).
    scales: list[float] = field(default_factory=list)
    tolerance: float = 3.0


@dataclass
class BatchConfig:
    """`data.batch`: how any source's samples are batched, as in WAP: sorted, then each batch filled under a pixel
    budget."""

    bucket_by: BucketBy = BucketBy.size  # sort by image size (WAP) or by label length (tokens)
    curriculum_epochs: int = 0  # the first N epochs go from the shortest labels to the longest; 0 = shuffled
    pixel_budget: int = 120000
    max_batch: int = 16
    max_image_pixels: int = 120000  # larger images are dropped, as WAP does
    max_tokens: int = 200  # longer labels are dropped
    num_workers: int = 0


BATCH_KEYS = tuple(f.name for f in fields(BatchConfig))


def nest_batch_keys(data: dict) -> dict:
    """A data config from before `data.batch`: its batching keys moved into it (others kept as they are)."""
    if not isinstance(data, dict) or not any(k in data for k in BATCH_KEYS):
        return data
    moved = {k: data[k] for k in BATCH_KEYS if k in data}
    return {
        **{k: v for k, v in data.items() if k not in BATCH_KEYS},
        "batch": {**moved, **(data.get("batch") or {})},
    }


@dataclass
class DataConfig:
    """The keys every source reads or may read (the folders, the raster, the batching, the augmentation of the
    pixels); a source's own keys are in its subclass below, or in `data.options` for a source of one's own."""

    name: str = "source"  # the source's name, in logs and messages
    # The source: a class of wapstable/data/sources/ (or of the user's own) with splits(cfg_data, which); a source of
    # one's own takes its keys in `options`, typed and checked by its Options dataclass (docs/extending.md)
    _target_: str = "???"
    options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = "${oc.env:WAPSTABLE_CACHE,${oc.env:HOME,.}/.cache/wapstable}"
    # base: the grammar's 85 symbols; crohme: all 110 of the CROHME 2014 dictionary, in the constructions real
    # expressions use them in (functions, limits, lists, primes, sets...), and the CROHME vocabulary
    symbols: SymbolSet = SymbolSet.base
    # A fresh random affine warp of each training image at every step, boxes moved with it (wapstable/data/warp.py);
    # its strength: 1 = up to 1.5 degrees of rotation, 0.15 of shear, 15 % of shrink, 2 px of shift. 0 = off.
    warp: float = 0.0
    pixel_aug: PixelAugConfig = field(default_factory=PixelAugConfig)
    # wap_pkl, images: every image brought to the model's own ink (wapstable/data/normalize.py): polarity, contrast,
    # symbol size and pen width measured and, where they lie outside the range the checkpoint's model saw in
    # training, resampled to its ink statistics (evaluation, prediction, resume), or for a new model to `ink_stroke` /
    # `ink_symbol` px (as measured on the project's InkML raster at data.line_width=2, data.symbol_size=24); false =
    # the images as they are
    normalize: bool = False
    ink_stroke: float = 2.3
    ink_symbol: float = 31.0
    read_range: ReadRangeConfig = field(default_factory=ReadRangeConfig)
    render_workers: int = 2
    # real data (crohme: folders of InkML files; wap_pkl: pickles + captions + dictionary)
    root: str | None = None
    train: str = "train"
    valid: str | None = "valid"  # crohme: empty = held out from data.train by label (data.valid_fraction)
    valid_fraction: float = 0.05
    test: str = "test"
    # crohme: test set name -> folder, each evaluated and reported on its own; null = the one folder data.test
    test_sets: dict[str, str] | None = None
    dictionary: str | None = None
    # InkML to pixels: scale=height draws every image `height` px high; scale=symbol keeps the ink's scale, a
    # typical symbol (the median stroke) `symbol_size` px, images up to `height` px high
    scale: InkScale = InkScale.height
    height: int = 64
    symbol_size: int = 24
    line_width: int = 2
    on_error: OnError = OnError.fail
    batch: BatchConfig = field(default_factory=BatchConfig)  # how the samples are batched (data.batch.*)


@dataclass
class SyntheticData(DataConfig):
    """data=synthetic's own keys: what it renders and how (wapstable/data/sources/synthetic.py)."""

    num_train: int = 3000
    num_valid: int = 200
    num_test: int = 200
    difficulty: int = 2  # 1 = flat strings .. 4 = deep nesting of fractions, scripts, roots and big operators
    fonts: list[str] = field(default_factory=lambda: ["cm", "stix", "dejavuserif", "dejavusans", "stixsans"])
    font_size: int = 16
    augment: bool = True
    # with symbols=crohme, how often each symbol and construction is drawn; grammar: the grammar's own weights (most
    # symbols alike); crohme: as often as in the CROHME 2014 training labels (their symbol counts, text only, mixed
    # a quarter with uniform so that rare symbols are still drawn), scripts inside fractions and roots as they use them
    frequencies: Frequencies = Frequencies.grammar
    # printed: filled font outlines; handwritten: the same layout drawn as jittered pen strokes (stroke fonts),
    # rasterised like data=crohme's ink (data.scale, height, symbol_size, line_width)
    style: InkStyle = InkStyle.printed
    # handwritten: where each symbol's strokes come from; fonts: the stroke fonts (no real ink); crohme: real
    # symbols cut from the traceGroups of data.root/data.train (held-out validation expressions excluded), the fonts
    # for symbols it lacks
    glyphs: GlyphSource = GlyphSource.fonts
    # handwritten, with data.augment: the strength of each glyph's random scale, rotation, shift and stroke wobble
    # and of the expression's slant (1: scale 8 %, rotation 4 degrees, wobble 2.5 % of the font size; 0: none)
    jitter: float = 1.0
    # handwritten, with data.augment: how far each glyph's shape is changed (0: not at all; 1: each stroke shifted
    # 3 %, turned 5 degrees, scaled 8 % on its own, the glyph bent by up to 6 % of the font size; data/handwriting.py)
    distort: float = 0.0
    # handwritten, with data.augment: the chance that a symbol with other hand-written forms (a bare 1, a looped 2, an
    # open 4, an x of two arcs...: data/handwriting.py ALLOGRAPHS) is drawn in one of them instead of its font's (0..1)
    allographs: float = 0.0
    # handwritten, with data.augment: the chance that one of the symbols of MORE_FORMS (data/handwriting.py: 0 6 c l s
    # u v B ( ) \beta and the root's sign, which ALLOGRAPHS leaves to the fonts) is drawn in one of the forms
    # writers give it there (0..1); 0 draws every image as before
    more_forms: float = 0.0
    # handwritten, with data.augment: the chance that a script is drawn where writers put it rather than where mathtext
    # does (0..1): a subscript 0.75 times as large, lower and further right, a superscript higher (data/handwriting.py
    # SCRIPT_MOVES, measured on the CROHME training files)
    script_place: float = 0.0
    # handwritten, with data.augment: the chance that a glyph is drawn in a stroke font drawn anew for it (by the
    # fonts' chances) rather than in its expression's one font, so that one expression mixes hands' letter shapes (0..1)
    font_mix: float = 0.0
    # handwritten, with data.augment: how far apart neighbouring symbols are set beyond mathtext's spacing, in the
    # gap writers add (1: 0.2 of a letter's height on average, measured on CROHME ink; data/handwriting.py SYMBOL_GAP)
    spacing: float = 0.0
    # handwritten, with data.augment and data.scale=symbol: the spread of each expression's size, on a log scale: its
    # typical symbol drawn data.symbol_size times exp(N(0, size_jitter)) px (0: all at data.symbol_size; 0.2 spreads
    # them as the letter heights of CROHME writers spread; at most 1)
    size_jitter: float = 0.0
    seed: int = 0


@dataclass
class CrohmeData(DataConfig):
    """data=crohme's own keys: more drawings of its training files (wapstable/data/ink/redraw.py)."""

    # crohme: N more drawings of each training file (never of the validation or test files), each as another hand
    # would write it: every symbol (traceGroup) moved, scaled, turned and bent on its own, the expression slanted
    # and stretched, its scale varied; `redraw_strength` scales every figure (1: data/crohme.py, redraw_traces)
    redraw: int = 0
    redraw_strength: float = 1.0


# data._target_ -> the schema of the source's keys; any other source has the shared keys only (its own in options)
SCHEMAS: dict[str, type[DataConfig]] = {
    "wapstable.data.sources.synthetic.SyntheticSource": SyntheticData,
    "wapstable.data.sources.crohme.CrohmeSource": CrohmeData,
}
# every key a built-in source has owned: a checkpoint from before the sources owned their keys holds all of them
OWNED_KEYS = frozenset(f.name for schema in SCHEMAS.values() for f in fields(schema)) - {
    f.name for f in fields(DataConfig)
}


def data_schema(target: Any) -> type[DataConfig]:
    """The schema of the source `data._target_` names (its keys and the shared ones)."""
    return SCHEMAS.get(str(target), DataConfig)


def owned_keys_only(saved: dict) -> dict:
    """A checkpoint's data config without the keys of other built-in sources (every checkpoint written before the
    sources owned their keys holds all of them, at their defaults)."""
    if not isinstance(saved, dict):
        return saved
    own = {f.name for f in fields(data_schema(saved.get("_target_")))}
    return {k: v for k, v in saved.items() if k in own or k not in OWNED_KEYS}
