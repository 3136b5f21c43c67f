"""The on-disk caches of rendered data (data=synthetic, data=crohme): images packed into one array, written
atomically as an .npz that loads without pickle."""

import os
import tempfile
from pathlib import Path

import numpy as np


def pack_images(images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(shapes (N, 2), pixels): the images' shapes and their pixels concatenated, for one .npz entry each."""
    shapes = np.array([im.shape for im in images], dtype=np.int64).reshape(-1, 2)
    pixels = np.concatenate([im.ravel() for im in images]) if images else np.zeros(0, np.uint8)
    return shapes, pixels


def unpack_images(shapes: np.ndarray, pixels: np.ndarray) -> list[np.ndarray]:
    """The images of pack_images; ValueError when the pixel count does not match the shapes."""
    ends = np.cumsum(shapes[:, 0] * shapes[:, 1])
    if len(ends) and ends[-1] != pixels.size or not len(ends) and pixels.size:
        raise ValueError("the pixel count does not match the image shapes")
    starts = ends - shapes[:, 0] * shapes[:, 1]
    return [pixels[a:b].reshape(h, w) for a, b, (h, w) in zip(starts, ends, shapes)]


def write_npz(path: Path, arrays: dict, compress: bool = False) -> None:
    """Write `arrays` to `path` atomically (a temporary file in the same folder, fsync, rename), readable by all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        with os.fdopen(fd, "wb") as f:
            (np.savez_compressed if compress else np.savez)(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
