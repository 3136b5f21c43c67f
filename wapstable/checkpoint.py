"""Checkpoints: written atomically, loaded with `weights_only=True`, versioned and checksummed.

A checkpoint is a dict of plain data (tensors, numbers, strings, lists, dicts) so that
`torch.load(path, weights_only=True)` loads it without running code. The write goes to a temporary file in the
same folder, is flushed to disk, then renamed over the target: a run killed at any moment leaves either the old
file or the new one, never half of one.
"""

import contextlib
import errno
import glob
import hashlib
import os
import pickle
import random
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from wapstable.errors import UserError

FORMAT = "wapstable-checkpoint"
VERSION = 1


def tensor_checksum(obj) -> str:
    """SHA-256 over every tensor in a nested structure, in a fixed order (keys sorted)."""
    h = hashlib.sha256()

    def visit(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                visit(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                visit(v)

    visit(obj)
    return h.hexdigest()


def save_checkpoint(state: dict, path: str | Path) -> Path:
    """Write `state` (plus format, version and checksum) to `path` atomically; returns the path.

    A full disk raises UserError naming the file; the earlier file at `path`, if any, is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "checksum": tensor_checksum(state), "state": state}
    prefix = f".{path.name}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            out = _WriteErrors(f)
            try:
                torch.save(payload, out)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(
                f"the disk is full ({e.strerror}) while writing checkpoint {path}; nothing was replaced, so an "
                f"earlier {path.name} is intact. Free some space, then continue with resume=auto"
            ) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a power cut
    # A run killed during a write (SIGKILL, node failure) leaves its temporary file behind; only this process
    # writes `path`, so any other temporary file of the same name is such a leftover.
    for stale in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        with contextlib.suppress(OSError):  # a leftover that cannot go costs space, not correctness
            stale.unlink()
    return path


class _WriteErrors:
    """The file torch.save writes to, keeping the OSError of a failed write.

    torch.save reports a failed write (a full disk) as a bare RuntimeError ("unexpected pos"), without the errno
    that says what went wrong; this keeps it.
    """

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened or synced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path: str | Path, verify: bool = True) -> dict:
    """The state saved by `save_checkpoint`; any other file is refused with a message naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; check the path given to resume=")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch words it "Unsupported global: GLOBAL x.y", or for a blocked module such as os/posix (the
        # dangerous case) "unsupported GLOBAL posix.system whose module posix is blocked"
        found = re.search(r"[Uu]nsupported(?: global:)? GLOBAL (\S+)", str(e))
        if found:
            raise UserError(
                f"checkpoint {path} carries a pickled Python object ({found.group(1)}), which is refused because "
                "checkpoints load with weights_only=True; re-save it as plain tensors and data"
            ) from None
        raise UserError(f"{path} is truncated or not a checkpoint; use another checkpoint") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError):
        raise UserError(f"{path} is truncated or not a checkpoint; use another checkpoint") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path} is not a wapstable checkpoint; give resume= a file written by this trainer")
    if payload.get("version") != VERSION:
        raise UserError(
            f"{path} has checkpoint format version {payload.get('version')}, this trainer reads version {VERSION}"
        )
    if verify and tensor_checksum(payload["state"]) != payload.get("checksum"):
        raise UserError(
            f"{path} failed its checksum: its tensors were changed or damaged; use another checkpoint"
        )
    return payload["state"]


def rng_state() -> dict:
    """Python, NumPy and torch RNG states as plain data (loadable with weights_only)."""
    np_state = np.random.get_state()
    state = {
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def inference_weights(state: dict) -> dict:
    """The weights a checkpoint is read with: its average where the run kept one (trainer.ema_decay), else its
    training weights."""
    ema = state.get("ema")
    return ema["weights"] if isinstance(ema, dict) and "weights" in ema else state["model"]
