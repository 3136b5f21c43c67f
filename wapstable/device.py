"""The device a run computes on, and its precision: shared by training, replay, evaluation and prediction."""

import contextlib
import warnings

import torch

from wapstable.errors import UserError


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when there is one), `cpu`, `cuda` or `cuda:N`; a clear error for anything else."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu or auto")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UserError(f"trainer.device={name!r} is unknown; use auto, cpu or cuda")
    return torch.device(name)


def autocast(device: torch.device, precision: str):
    """The autocast context of `trainer.precision`: none for 32, bf16 or fp16 otherwise."""
    if precision == "32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def cuda_sync_warnings():
    """The warnings CUDA's sync debug mode raises while the block runs, one per host synchronisation (a list, filled
    as the block runs): how the benchmark and the GPU check count syncs on CUDA."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(0)
