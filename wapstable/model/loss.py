"""The WAP loss of a batch: the sequence loss, CAN's counting loss, and the forward that computes them.

Used by the trainer, by the anomaly replay and by the benchmark; the step's backward, decision, clipping and
optimizer step are `wapstable.stability.StepGuard`'s.
"""

import torch
import torch.nn.functional as F

from wapstable.device import autocast


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """WAP's cost: negative log-likelihood summed over the tokens of each label, averaged over the batch."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # (B*T,)
    return (nll.view_as(target_mask) * target_mask).sum() / targets.shape[0]


def counting_loss(counts: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """CAN's counting loss: smooth L1 between predicted and true symbol counts, summed over the vocabulary (the
    end token `<eol>` left out) and averaged over the batch, like the sequence loss."""
    truth = torch.zeros_like(counts).scatter_add_(1, targets, target_mask.to(counts.dtype))  # (B, V)
    return F.smooth_l1_loss(counts[:, 1:], truth[:, 1:], reduction="sum") / targets.shape[0]


def forward_loss(model, batch, fault=None, step: int = -1, precision: str = "32"):
    """The training loss of one batch, with `fault` applied when given (an object with `batch(images, step)` and
    `loss(loss, step)`, as `wapstable.stability.faults.Fault`; used by training and by replay):
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
