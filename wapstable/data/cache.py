"""The on-disk caches of read and rendered data (synthetic splits, CROHME and image folders, the glyph bank): images
packed into one array, each file an .npz that loads without pickle.

A file is written atomically (a temporary file in its folder, then a rename), so a reader sees a whole file or
none; a folder that cannot be written (read-only, full) is a UserError naming it, with nothing half-written left
behind. A file that cannot be read (torn, foreign, of another layout) is only a lost cache: a warning, and it is
built again. Each cache's key holds the settings that change its pixels and the hash of the code that draws them
(`code_hash`), so that neither a new setting nor a new drawing is read from an old file.
"""

import ast
import errno
import hashlib
import importlib.util
import logging
import os
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

import numpy as np

from wapstable.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")


def pack_images(images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(shapes (N, 2), pixels): the images' shapes and their pixels concatenated, for one .npz entry each."""
    shapes = np.array([im.shape for im in images], dtype=np.int64).reshape(-1, 2)
    pixels = np.concatenate([im.ravel() for im in images]) if images else np.zeros(0, np.uint8)
    return shapes, pixels


def unpack_images(shapes: np.ndarray, pixels: np.ndarray) -> list[np.ndarray]:
    """The images of pack_images; ValueError when the pixel count does not match the shapes."""
    if shapes.ndim != 2 or shapes.shape[1] != 2 or (shapes < 0).any() or pixels.dtype != np.uint8:
        raise ValueError(f"{shapes.shape} image shapes and {pixels.dtype} pixels are not images")
    ends = np.cumsum(shapes[:, 0] * shapes[:, 1])
    if len(ends) and ends[-1] != pixels.size or not len(ends) and pixels.size:
        raise ValueError("the pixel count does not match the image shapes")
    starts = ends - shapes[:, 0] * shapes[:, 1]
    return [pixels[a:b].reshape(h, w) for a, b, (h, w) in zip(starts, ends, shapes)]


def unwritable(folder: Path, e: OSError) -> UserError:
    """The one sentence for a cache folder that cannot be written, saying what to do about it."""
    reason = e.strerror or type(e).__name__
    fixes = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there"}
    fixes |= {errno.ENOTDIR: "move away the file in its path", errno.EEXIST: "move away the file in its path"}
    fix = fixes.get(e.errno, "make it writable")
    return UserError(
        f"cannot write the data cache in {folder} ({reason}); {fix}, or set data.cache_dir (or WAPSTABLE_CACHE) to "
        "a writable folder"
    )


def check_writable(folder: Path) -> None:
    """Make `folder` and a scrap file in it: a cache that cannot be written is refused before the work whose
    result it would keep, not after (a full disk shows only when the file is written: write_npz)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise unwritable(folder, e) from None


def write_npz(path: Path, arrays: dict, compress: bool = False) -> None:
    """Write `arrays` to `path` atomically (a temporary file in the same folder, fsync, rename), readable by all; a
    folder that cannot be written is a UserError (unwritable), and the temporary file is gone."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        with os.fdopen(fd, "wb") as f:
            (np.savez_compressed if compress else np.savez)(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise unwritable(path.parent, e) from None
        raise


def read_npz(path: Path, read: Callable[[np.lib.npyio.NpzFile], T], again: str) -> T | None:
    """`read` of the open .npz at `path` (it raises on arrays that do not agree), or None when there is no such
    file or it cannot be read: a torn or foreign file is only a lost cache, logged with `again` (what is done
    instead, "rendering it again"), never a failed run."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return read(z)
    except Exception as e:  # a bad zip, a missing array, an array of the wrong shape or count
        log.warning("the cache %s is unreadable (%s: %s); %s", path, type(e).__name__, e, again)
        return None


def code_files(*modules: str) -> list[tuple[str, Path]]:
    """(name, file) of every module of `modules` (module names): a package stands for all of its modules, its
    subpackages' included, so a module added to it is covered without a change to any list of names."""
    out = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec.submodule_search_locations:  # a package
            folder = Path(spec.origin).parent
            for path in sorted(folder.rglob("*.py")):
                parts = path.relative_to(folder).with_suffix("").parts
                sub = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                out.append((f"{name}.{sub}" if sub else name, path))
        else:
            out.append((name, Path(spec.origin)))
    return out


@cache
def code_hash(*modules: str) -> str:
    """A hash of the code of `modules` (module or package names, code_files), without its comments, docstrings and
    layout: part of a cache's key, so that a change to the code that draws the pixels draws them again, with no
    version to bump."""
    digest = hashlib.sha256()
    for name, path in code_files(*modules):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, _DOCUMENTED) and ast.get_docstring(node, clean=False) is not None:
                node.body = node.body[1:] or [ast.Pass()]
        digest.update(f"{name}\n{ast.dump(tree)}\n".encode())
    return digest.hexdigest()[:16]


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
