"""The data caches (wapstable/data/cache.py): written atomically, a folder that cannot be written refused in one
sentence with nothing half-written left, a torn file built again, and a key that holds every data key that changes
the pixels (walked over the data schema, wapstable/data/schema.py) and the code that draws them."""

import copy
import dataclasses
import errno
import functools
import logging
import os
import shutil
import tempfile
from enum import Enum
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, compose_config, run_train
from omegaconf import DictConfig, OmegaConf

from wapstable.data import cache
from wapstable.data.batches import load_splits
from wapstable.data.ink import bank as ink_bank
from wapstable.data.schema import SCHEMAS, BatchConfig, DataConfig, PixelAugConfig, ReadRangeConfig
from wapstable.data.sources import crohme, images, synthetic
from wapstable.errors import UserError

TINY_RENDER = ["data.num_train=2", "data.num_valid=1", "data.num_test=1", "data.render_workers=0"]
# Data configs that fill each cache: name -> Hydra overrides ({crohme}, {ink}, {images}: the folders of `roots`)
CONTEXTS = {
    "printed": TINY_RENDER,
    "printed, crohme symbols": [*TINY_RENDER, "data.symbols=crohme"],
    "handwritten": [*TINY_RENDER, "data.style=handwritten", "data.scale=symbol"],
    "real glyphs": [
        *TINY_RENDER,
        "data.style=handwritten",
        "data.glyphs=crohme",
        "data.root={ink}",
        "data.train=TrainINKML",
    ],
    "crohme": ["data=crohme", "data.root={crohme}", "data.valid_fraction=0.3", "data.render_workers=0"],
    "crohme, scale=symbol": [
        "data=crohme",
        "data.root={crohme}",
        "data.scale=symbol",
        "data.render_workers=0",
    ],
    "crohme, redraw": ["data=crohme", "data.root={crohme}", "data.redraw=1", "data.render_workers=0"],
    "crohme, one test folder": [
        "data=crohme",
        "data.root={crohme}",
        "data.test_sets=null",
        "data.test=TestEM2014GT",
        "data.render_workers=0",
    ],
    "images": ["data=images", "data.root={images}", "data.valid_fraction=0.3"],
}
# the cache each of these contexts writes first, and the function that does the work the cache keeps
FIRST_CACHE = {
    "printed": ("synthetic/*/splits.npz", synthetic, "_render_all"),
    "crohme": ("crohme/*/TrainINKML.npz", crohme, "read_inkml"),
    "images": ("images/*/train.npz", images, "read_picture"),
    "real glyphs": ("glyphs/*/bank.npz", ink_bank, "_build"),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """Small data sets of each kind, and a second of each: {crohme}, {crohme2}, {ink}, {ink2}, {images}, {images2};
    each with a folder "Other" ("other") beside its own."""
    from test_crohme import published_layout, write
    from test_guidance import INKML
    from test_handwriting import ink_folder
    from test_images import comer_folder

    tmp = tmp_path_factory.mktemp("roots")
    out = {}
    second = ("y-1", "x_1", "a-b", "c+1", "\\sqrt{y}", "z^3")
    for name, labels in (("crohme", ("x^2", "a+b", "\\frac{1}{2}") * 4), ("crohme2", second * 2)):
        root = published_layout(tmp / name, labels)
        (root / "Other").mkdir()
        for i, label in enumerate(("b^2", "c+d", "y-1", "x_1", "a-b", "z^3")):
            write(root / "Other" / f"other_{i}.inkml", truth=f"${label}$")
        out[name] = root
    for name, copies in (("ink", 3), ("ink2", 4)):
        out[name] = ink_folder(tmp / name, copies).parent
        (out[name] / "Other").mkdir()
        (out[name] / "Other" / "o.inkml").write_text(INKML)
    for name in ("images", "images2"):
        out[name] = comer_folder(tmp / name, ("train", "test", "other"))
    return out


def data_cfg(context: str, roots: dict, cache_dir: Path, **changes) -> DictConfig:
    """The composed `data` of `context`, reading and writing `cache_dir`, with `changes` (key: value) on top."""
    cfg = copy.deepcopy(composed(tuple(o.format(**roots) for o in CONTEXTS[context])))
    cfg.cache_dir = str(cache_dir)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


@functools.cache
def composed(overrides: tuple[str, ...]) -> DictConfig:
    return compose_config(list(overrides)).data


def cached(cache_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every cache file under `cache_dir` (by its path there) with its arrays."""
    return {str(path.relative_to(cache_dir)): arrays_of(path) for path in sorted(cache_dir.rglob("*.npz"))}


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def same_arrays(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f")


def files_in(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


# -----------------------------------------------------------------------------
# a folder that cannot be written: a full disk, a read-only folder


def full_disk(real):
    """np.savez (or savez_compressed) on a disk that fills up: half the file written, then ENOSPC."""

    def save(f, **arrays):
        real(f, **{k: v[: len(v) // 2] if v.ndim else v for k, v in arrays.items()})
        raise OSError(errno.ENOSPC, "No space left on device")

    return save


def test_a_full_disk_keeps_the_old_file_whole_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "c" / "a.npz"
    cache.write_npz(path, {"x": np.arange(1000)})
    monkeypatch.setattr(np, "savez", full_disk(np.savez))
    with pytest.raises(UserError) as e:
        cache.write_npz(path, {"x": np.arange(2000)})
    assert str(e.value) == (
        f"cannot write the data cache in {path.parent} (No space left on device); free space there, or set "
        "data.cache_dir (or WAPSTABLE_CACHE) to a writable folder"
    )
    assert files_in(tmp_path) == [path]  # no temporary file beside it
    with np.load(path) as z:
        assert np.array_equal(z["x"], np.arange(1000))  # the file a reader may hold is the old one, whole


@pytest.mark.parametrize("context", sorted(FIRST_CACHE))
def test_a_full_disk_while_writing_a_cache_is_one_sentence(tmp_path, roots, monkeypatch, context):
    monkeypatch.setattr(np, "savez", full_disk(np.savez))
    monkeypatch.setattr(np, "savez_compressed", full_disk(np.savez_compressed))
    with pytest.raises(UserError) as e:
        load_splits(data_cfg(context, roots, tmp_path / "cache"))
    folder = str(e.value).split("cannot write the data cache in ", 1)[1].split(" (")[0]
    assert Path(folder).match(str(Path(FIRST_CACHE[context][0]).parent)), str(e.value)
    assert "(No space left on device); free space there, or set data.cache_dir" in str(e.value)
    assert "\n" not in str(e.value)
    assert files_in(tmp_path / "cache") == []  # nothing half-written


@pytest.mark.parametrize("errno_", [errno.EROFS, errno.EACCES])
@pytest.mark.parametrize("context", sorted(FIRST_CACHE))
def test_a_read_only_cache_is_refused_before_the_work(tmp_path, roots, monkeypatch, context, errno_):
    """Any user can run this one (root writes through a read-only mode): a folder where no file can be made."""
    _, module, work = FIRST_CACHE[context]
    monkeypatch.setattr(
        module, work, lambda *a, **k: pytest.fail(f"{work} ran although the cache is read-only")
    )
    cfg = data_cfg(context, roots, tmp_path / "cache")

    def read_only(*args, **kwargs):
        raise OSError(errno_, os.strerror(errno_), kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(UserError) as e:
        load_splits(cfg)
    assert f"({os.strerror(errno_)}); make it writable, or set data.cache_dir" in str(e.value)
    assert str(e.value).startswith(f"cannot write the data cache in {tmp_path / 'cache'}")
    assert not [p for p in files_in(tmp_path / "cache") if p.suffix == ".tmp"]


@pytest.mark.parametrize(
    "how", ["read-only folder", pytest.param("a file in the folder's place", marks=pytest.mark.slow)]
)
def test_train_py_on_a_cache_it_cannot_write_exits_2_with_one_sentence(tmp_path, how):
    folder = tmp_path / "cache"
    if how == "read-only folder":
        folder.mkdir()
        folder.chmod(0o555)
        if os_can_write(folder):
            folder.chmod(0o755)
            pytest.skip("this user (root) writes through a read-only mode; the other case covers the refusal")
    else:
        folder.write_text("a file where the cache folder should be")
    try:
        proc = run_train([], tmp_path / "run", folder, check=False)
    finally:
        if folder.is_dir():
            folder.chmod(0o755)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "error: " in line]
    assert proc.returncode == 2 and len(errors) == 1, out[-2000:]
    assert f"error: cannot write the data cache in {folder}" in errors[0], errors
    assert "or set data.cache_dir (or WAPSTABLE_CACHE) to a writable folder" in errors[0]
    assert "Traceback" not in out and "rendered" not in out  # refused before the render
    assert files_in(folder) == [] if folder.is_dir() else folder.is_file()


def os_can_write(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


# -----------------------------------------------------------------------------
# a torn file


def tear(path: Path, damage: str) -> None:
    """Damage a cache file as a crash, a foreign writer or a full disk of old would have."""
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not an npz file" * 10)
    else:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        largest = max(arrays, key=lambda k: arrays[k].size)
        if damage == "an array missing":
            del arrays[largest]
        else:  # one element short
            arrays[largest] = arrays[largest][:-1]
        with open(path, "wb") as f:
            np.savez(f, **arrays)


def same_splits(a, b):
    assert a.keys() == b.keys()
    for split in a:
        assert [s.id for s in a[split]] == [s.id for s in b[split]]
        assert [s.tokens for s in a[split]] == [s.tokens for s in b[split]]
        assert all(np.array_equal(x.image, y.image) for x, y in zip(a[split], b[split]))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "an array missing", "an array one short"])
@pytest.mark.parametrize("context", sorted(FIRST_CACHE))
def test_a_torn_cache_file_is_built_again(tmp_path, roots, caplog, context, damage):
    cfg = data_cfg(context, roots, tmp_path / "cache")
    first = load_splits(cfg)
    whole = cached(tmp_path / "cache")
    (path,) = (tmp_path / "cache").glob(FIRST_CACHE[context][0])
    tear(path, damage)
    ink_bank.load_bank.cache_clear()
    with caplog.at_level(logging.WARNING, logger="wapstable.data.cache"):
        again = load_splits(cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"the cache {path} is unreadable" in w and " again" in w for w in warnings), warnings
    same_splits(first, again)
    assert cached(tmp_path / "cache").keys() == whole.keys()  # whole again, in its place
    for name, arrays in cached(tmp_path / "cache").items():
        assert all(same_arrays(arrays[k], whole[name][k]) for k in arrays)
    if context == "real glyphs":  # and what the renderer draws from
        ink_bank.load_bank.cache_clear()
        assert sum(map(len, ink_bank.load_bank(str(path)).values())) == 4 * 3


@pytest.mark.slow  # make test-all
def test_train_py_renders_a_torn_cache_again(tmp_path):
    folder = tmp_path / "cache"
    cfg = compose_config(TINY).data  # the data of run_train's runs, into their cache
    cfg.cache_dir = str(folder)
    load_splits(cfg)
    (path,) = folder.glob("synthetic/*/splits.npz")
    tear(path, "truncated")
    proc = run_train([], tmp_path / "run", folder)
    assert f"the cache {path} is unreadable" in proc.stdout + proc.stderr
    assert "rendering it again" in proc.stdout + proc.stderr
    assert files_in(folder) == [path] and arrays_of(path)  # whole again, and nothing beside it


# -----------------------------------------------------------------------------
# the key: every data key that changes the pixels, and the code that draws them

# Each data key that changes what a cache holds, with the contexts in which changing it must give a new cache file
# (and the value it is changed to, where `other` cannot guess one).
KEYED = {
    "num_train": ["printed"],
    "num_valid": ["printed"],
    "num_test": ["printed"],
    "difficulty": ["printed"],
    "fonts": ["printed"],
    "font_size": ["printed", "handwritten"],
    "augment": ["printed", "handwritten"],
    "seed": ["printed", "handwritten"],
    "symbols": ["printed", "images"],
    "frequencies": ["printed, crohme symbols"],
    "style": ["printed"],
    "glyphs": ["real glyphs"],
    "jitter": ["handwritten"],
    "distort": ["handwritten"],
    "allographs": ["handwritten"],
    "more_forms": ["handwritten"],
    "script_place": ["handwritten"],
    "font_mix": ["handwritten"],
    "spacing": ["handwritten"],
    "size_jitter": ["handwritten"],
    "scale": ["handwritten", "crohme"],
    "height": ["handwritten", "crohme"],
    "symbol_size": ["handwritten", "crohme, scale=symbol"],
    "line_width": ["handwritten", "crohme"],
    "root": ["real glyphs", "crohme", "images"],
    "train": ["real glyphs", "crohme", "images"],
    "valid": ["crohme", "images"],
    "valid_fraction": ["real glyphs"],  # the bank leaves out the validation expressions' ink
    "test": ["crohme, one test folder", "images"],
    "test_sets": ["crohme", "images"],
    "redraw": ["crohme"],
    "redraw_strength": ["crohme, redraw"],
}
# Each data key that changes nothing a cache holds, and why. Changing one must leave every cache's key, and what a
# fresh cache holds, as they were (test_data_keys_that_change_no_pixels).
NOT_PIXELS = {
    "name": "names the source; each source caches under its own folder (synthetic/, crohme/, images/, glyphs/)",
    "_target_": "picks the source, which caches under its own folder",
    "options": "a source's own keys: the built-in sources have none (a source of one's own keys its own cache)",
    "cache_dir": "where the caches are, not what they hold",
    "warp": "a fresh warp of every training batch (data/warp.py), drawn after the cache",
    "pixel_aug": "a fresh augmentation of every training batch (data/pixel_aug.py), drawn after the cache",
    "normalize": "applied to every image as the splits are loaded (batches.load_splits), after the cache",
    "ink_stroke": "data.normalize's target, applied after the cache",
    "ink_symbol": "data.normalize's target, applied after the cache",
    "read_range": "what the end of training measures on the loaded validation split, after the cache",
    "render_workers": "how many processes render or read: the same pixels with any number (seeded per sample)",
    "dictionary": "the vocabulary file, read apart from the images (batches.load_vocab)",
    "on_error": "what a bad file does to the run; every bad file is cached as an error and judged on each load",
    # batching and its order, the filters on the loaded training samples (build.build_data), DataLoader processes
    "batch": "how the loaded samples are batched (data.batch.*), after the cache",
}
NOT_TRIED = {
    "name",
    "_target_",
    "options",
    "cache_dir",
}  # changing them changes where a cache is, not its key
MAIN_CONTEXTS = ("printed", "handwritten", "real glyphs", "crohme", "images")


def other(key: str, value, context: str, roots: dict):
    """A valid other value of data.`key` in `context`."""
    folders = {"crohme": "Other", "images": "other", "real glyphs": "Other"}
    where = context.split(",")[0]
    special = {
        "root": lambda: str(roots[{"crohme": "crohme2", "images": "images2", "real glyphs": "ink2"}[where]]),
        "train": lambda: folders[where],
        "valid": lambda: folders[where],
        "test": lambda: folders[where],
        "test_sets": lambda: {"x": folders[where]},
        "pixel_aug": lambda: PixelAugConfig([0.7, 1.4], 0.5, 0.5, 0.5),
        "read_range": lambda: ReadRangeConfig([0.7, 1.4], 5.0),
        "dictionary": lambda: "dictionary.txt",
        "render_workers": lambda: 2,
        "batch": lambda: BatchConfig("tokens", 1, 99999, 3, 10**7, 500, 1),  # every batching key changed
    }
    if key in special:
        return special[key]()
    if isinstance(value, bool):
        return not value
    if isinstance(value, Enum):
        return next(m for m in type(value) if m != value).name
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    if OmegaConf.is_list(value) and len(value) > 1:
        return list(value)[:1]
    raise AssertionError(f"give test_cache.other a value to change data.{key}={value!r} to")


def test_every_data_key_is_keyed_or_said_to_change_no_pixels():
    """A new key of the data schema (the shared DataConfig or a built-in source's own) fails here until it is put in
    KEYED (and so into the key of the caches it changes) or in NOT_PIXELS, with the reason."""
    keys = {f.name for schema in (DataConfig, *SCHEMAS.values()) for f in dataclasses.fields(schema)}
    assert not KEYED.keys() & NOT_PIXELS.keys()
    undecided = keys - KEYED.keys() - NOT_PIXELS.keys()
    assert not undecided, f"data.{sorted(undecided)}: add each to KEYED or NOT_PIXELS in tests/test_cache.py"
    assert not (KEYED.keys() | NOT_PIXELS.keys()) - keys, "KEYED or NOT_PIXELS names a key no data schema has"


@pytest.fixture(scope="module")
def warm(tmp_path_factory, roots):
    """One cache per context, filled with the context's own data: context -> its folder."""
    base = tmp_path_factory.mktemp("warm")
    for context in CONTEXTS:
        load_splits(data_cfg(context, roots, base / context))
    return base


def added_files(context: str, roots: dict, warm: Path, folder: Path, **changes) -> set[str]:
    """The cache files that loading `context` with `changes` adds to `folder`, a copy of the context's warm cache."""
    shutil.copytree(warm / context, folder)
    before = set(cached(folder))
    load_splits(data_cfg(context, roots, folder, **changes))
    return set(cached(folder)) - before


@pytest.mark.parametrize("key", sorted(KEYED))
def test_data_keys_that_change_pixels_are_in_the_key(tmp_path, roots, warm, key):
    for n, context in enumerate(KEYED[key]):
        value = other(key, data_cfg(context, roots, tmp_path)[key], context, roots)
        added = added_files(context, roots, warm, tmp_path / str(n), **{key: value})
        assert added, f"data.{key}={value} read {context} data from the cache of data.{key} as it was"


@pytest.mark.parametrize("key", sorted(NOT_PIXELS.keys() - NOT_TRIED))
def test_data_keys_that_change_no_pixels(tmp_path, roots, warm, key):
    """Changing the key reads every cache as it was, and a cache filled afresh with it holds what the old one does:
    a key that did change the pixels, and so belongs in KEYED, fails here."""
    tried = 0
    for n, context in enumerate(MAIN_CONTEXTS):
        value = other(key, data_cfg(context, roots, tmp_path)[key], context, roots)
        try:
            added = added_files(context, roots, warm, tmp_path / f"warm{n}", **{key: value})
        except UserError:  # refused in this context: nothing cached
            continue
        assert not added, f"data.{key}={value} changed the key of {context} data; is it in KEYED?"
        fresh = tmp_path / f"fresh{n}"
        load_splits(data_cfg(context, roots, fresh, **{key: value}))
        for name, arrays in cached(fresh).items():
            assert (warm / context / name).is_file(), f"data.{key}={value} changed the key of {context} data"
            old = arrays_of(warm / context / name)
            for k, v in arrays.items():
                assert same_arrays(v, old[k]), (
                    f"data.{key}={value} changed {k} of {name} ({context}): put it in KEYED, and in the key"
                )
        tried += 1
    assert tried, f"data.{key} was refused in every context"


def test_code_hash_follows_the_code_not_its_comments(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "drawing_for_test_cache.py"

    def hash_of(source: str) -> str:
        module.write_text(source)
        cache.code_hash.cache_clear()
        return cache.code_hash("drawing_for_test_cache")

    code = 'def draw(x):\n    """Ink."""\n    return x + 1\n'
    first = hash_of(code)
    reworded = '"""A module."""\n# why\ndef draw(x):  # why\n    """Other words."""\n\n    return (x + 1)\n'
    assert hash_of(reworded) == first
    assert hash_of(code.replace("x + 1", "x + 2")) != first
    cache.code_hash.cache_clear()


def test_code_hash_of_a_package_follows_each_of_its_modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    package = tmp_path / "drawing_package_for_test_cache"
    (package / "inner").mkdir(parents=True)
    for path in (package / "__init__.py", package / "inner" / "__init__.py"):
        path.write_text("")
    (package / "inner" / "pen.py").write_text("def draw(x):\n    return x + 1\n")
    cache.code_hash.cache_clear()
    first = cache.code_hash("drawing_package_for_test_cache")
    (package / "inner" / "pen.py").write_text("def draw(x):\n    return x + 2\n")
    cache.code_hash.cache_clear()
    assert cache.code_hash("drawing_package_for_test_cache") != first
    cache.code_hash.cache_clear()


def test_every_module_that_draws_is_in_its_cache_s_code():
    """The code lists name the packages that draw, which stand for all of their modules: a module added to
    wapstable/data/render or wapstable/data/ink is in the key of the data it draws without a list to update."""

    def modules(package: str) -> set[str]:
        folder = Path(cache.__file__).parent / package
        return {f"wapstable.data.{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}

    def covered(code) -> set[str]:
        return {name for name, _ in cache.code_files(*code)}

    drawing = covered(synthetic.DRAWING_CODE)
    assert modules("render") | {"wapstable.data.ink.raster", "wapstable.data.latex"} <= drawing
    reading = covered(crohme.READING_CODE)
    assert modules("ink") | {"wapstable.data.render.glyphs", "wapstable.data.sources.crohme"} <= reading
    assert {"wapstable.data.ink.bank", "wapstable.data.ink.inkml"} <= covered(ink_bank.CUTTING_CODE)
    assert "wapstable.data.sources.images" in covered(images.READING_CODE)


@pytest.mark.parametrize("context", sorted(FIRST_CACHE))
def test_each_cache_is_keyed_by_the_code_that_fills_it(tmp_path, roots, monkeypatch, context):
    pattern, module, _ = FIRST_CACHE[context]
    load_splits(data_cfg(context, roots, tmp_path))
    (first,) = tmp_path.glob(pattern)
    monkeypatch.setattr(module, "code_hash", lambda *modules: "another drawing")
    load_splits(data_cfg(context, roots, tmp_path))
    assert len(list(tmp_path.glob(pattern))) == 2 and first.is_file()
