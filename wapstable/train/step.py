"""One training step's forward: the WAP loss of a batch (with a configured fault), its precision, its device.

Used by the trainer, by the anomaly replay and by the benchmark; the step's backward, decision, clipping and
optimizer step are `wapstable.stability.StepGuard`'s.
"""

import contextlib

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..stability.faults import Fault


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """WAP's cost: negative log-likelihood summed over the tokens of each label, averaged over the batch."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # (B*T,)
    return (nll.view_as(target_mask) * target_mask).sum() / targets.shape[0]


def counting_loss(counts: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """CAN's counting loss: smooth L1 between predicted and true symbol counts, summed over the vocabulary (the
    end token `<eol>` left out) and averaged over the batch, like the sequence loss."""
    truth = torch.zeros_like(counts).scatter_add_(1, targets, target_mask.to(counts.dtype))  # (B, V)
    return F.smooth_l1_loss(counts[:, 1:], truth[:, 1:], reduction="sum") / targets.shape[0]


def forward_loss(model, batch, fault: Fault | None = None, step: int = -1, precision: str = "32"):
    """The training loss of one batch, with the configured fault applied (used by training and by replay):
    the sequence loss, plus `model.counting` x the counting loss when the model has a counting head."""
    images = fault.batch(batch.images, step) if fault else batch.images
    core = model.module if hasattr(model, "module") else model  # DDP wraps the WAP
    weight = float(getattr(core, "counting_weight", 0.0))
    with autocast(images.device, precision):
        out = model(images, batch.image_mask, batch.targets, batch.target_mask, with_counts=weight > 0)
    logits, counts = out if weight > 0 else (out, None)
    loss = sequence_loss(logits, batch.targets, batch.target_mask)
    if counts is not None:
        loss = loss + weight * counting_loss(counts, batch.targets, batch.target_mask)
    return fault.loss(loss, step) if fault else loss


def autocast(device: torch.device, precision: str):
    if precision == "32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu or auto")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UserError(f"trainer.device={name!r} is unknown; use auto, cpu or cuda")
    return torch.device(name)
