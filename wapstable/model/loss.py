"""The WAP loss of a batch: the sequence loss, CAN's counting loss, the attention guide, and the forward that
computes them.

Used by the trainer, by the anomaly replay and by the benchmark; the step's backward, decision, clipping and
optimizer step are `wapstable.stability.StepGuard`'s.
"""

import torch
import torch.nn.functional as F

from wapstable.device import autocast


def sequence_loss(
    logits: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor, smoothing: float = 0.0
) -> torch.Tensor:
    """WAP's cost: negative log-likelihood summed over the tokens of each label, averaged over the batch (with
    `smoothing` > 0, the cross-entropy against the label-smoothed targets)."""
    nll = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), reduction="none", label_smoothing=smoothing
    )  # (B*T,)
    return (nll.view_as(target_mask) * target_mask).sum() / targets.shape[0]


def counting_loss(counts: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """CAN's counting loss: smooth L1 between predicted and true symbol counts, summed over the vocabulary (the
    end token `<eol>` left out) and averaged over the batch, like the sequence loss."""
    truth = torch.zeros_like(counts).scatter_add_(1, targets, target_mask.to(counts.dtype))  # (B, V)
    return F.smooth_l1_loss(counts[:, 1:], truth[:, 1:], reduction="sum") / targets.shape[0]


def guide_weight(guide: dict | None, step: int) -> float:
    """The attention guide's weight at `step`: `weight`, falling linearly from step fade_start to 0 at fade_end
    (fade_end 0: no fade); 0 without a guide."""
    if not guide:
        return 0.0
    start, end = guide["fade_start"], guide["fade_end"]
    if end <= 0 or step <= start:
        return guide["weight"]
    return guide["weight"] * max(0.0, (end - step) / (end - start))


def guide_targets(regions: torch.Tensor, grid: tuple[int, int], stride: int) -> torch.Tensor:
    """How much of each token's box falls in each annotation cell: (B, T, h, w), in pixels squared.

    regions (B, T, 4) are boxes x0, y0, x1, y1 in the image's pixels (NaN: none); annotation cell (i, j) covers
    pixels [stride*i, stride*(i+1)) x [stride*j, stride*(j+1)) (the watcher's ceil-mode pools)."""
    h, w = grid
    r = torch.nan_to_num(regions.float(), nan=0.0)
    ys = torch.arange(h, device=r.device, dtype=r.dtype) * stride
    xs = torch.arange(w, device=r.device, dtype=r.dtype) * stride
    ox = (torch.minimum(r[..., 2:3], xs + stride) - torch.maximum(r[..., 0:1], xs)).clamp_min(0)  # (B, T, w)
    oy = (torch.minimum(r[..., 3:4], ys + stride) - torch.maximum(r[..., 1:2], ys)).clamp_min(0)  # (B, T, h)
    return oy.unsqueeze(-1) * ox.unsqueeze(-2)


def guide_loss(
    alphas: torch.Tensor, regions: torch.Tensor, target_mask: torch.Tensor, stride: int, kind: str = "inside"
) -> torch.Tensor:
    """The attention guide: for every target token with a box, a loss on that step's attention alphas (B, T, h, w)
    summed over the tokens of each label and averaged over the batch, like the sequence loss (tokens without a
    box, <eol> and padding add nothing).

    inside: -log of the attention mass on the cells the box touches (0 when all of it is there). kl: KL(q || alpha),
    q being the box's share of each cell (0 when the attention spreads over the box as its area does)."""
    a = alphas.float()
    area = guide_targets(regions, a.shape[-2:], stride)
    total = area.sum((-2, -1))
    use = torch.isfinite(regions).all(-1) & (total > 0) & (target_mask > 0)  # (B, T)
    if kind == "inside":
        mass = (a * (area > 0).to(a.dtype)).sum((-2, -1))
        per_token = -torch.log(mass + 1e-6)
    elif kind == "kl":
        q = area / total.clamp_min(1e-12)[..., None, None]
        per_token = (q * (torch.log(q + 1e-12) - torch.log(a + 1e-6))).sum((-2, -1))
    else:
        raise ValueError(f"model.attention.guide.kind must be inside or kl (got {kind!r})")
    return torch.where(use, per_token, torch.zeros_like(per_token)).sum() / alphas.shape[0]


def symbol_map_loss(
    logits: torch.Tensor, feat_mask: torch.Tensor, regions: torch.Tensor, targets: torch.Tensor, stride: int
) -> torch.Tensor:
    """The symbol map's loss: each annotation cell's cross-entropy against the symbols whose boxes cover it, in
    proportion to the area they cover, the rest of the cell being background (class 0, the `<eol>` row), summed over
    the valid cells of each image and averaged over the batch. logits (B, V, h, w), feat_mask (B, h, w), regions
    (B, T, 4) and targets (B, T). Images without any box (their data does not know where their symbols are) add
    nothing; so does a token without one (`{`, `^`, or one the data could not place)."""
    B, V, h, w = logits.shape
    area = guide_targets(regions, (h, w), stride)  # (B, T, h, w), 0 for a token without a box
    cover = torch.zeros(B, V, h, w, device=logits.device, dtype=area.dtype)
    cover.scatter_add_(1, targets[:, :, None, None].expand(-1, -1, h, w), area)
    background = (float(stride * stride) - cover.sum(1)).clamp_min(0.0)  # the cell's area no box covers
    cover[:, 0] += background
    q = cover / cover.sum(1, keepdim=True).clamp_min(1e-12)
    ce = -(q * F.log_softmax(logits.float(), 1)).sum(1)  # (B, h, w)
    has_boxes = torch.isfinite(regions).all(-1).any(-1)  # (B,)
    use = feat_mask.float() * has_boxes[:, None, None].float()
    return (ce * use).sum() / B


def forward_loss(model, batch, fault=None, step: int = -1, precision: str = "32"):
    """The training loss of one batch, with `fault` applied when given (an object with `batch(images, step)` and
    `loss(loss, step)`, as `wapstable.stability.faults.Fault`; used by training and by replay):
    the sequence loss, plus `model.counting` x the counting loss when the model has a counting head, plus the
    attention guide's weight at `step` x the guide loss when the model has a guide and the batch symbol boxes
    (its unweighted value is left in the model's `guide_value`, for the logs; None when not computed)."""
    images = fault.batch(batch.images, step) if fault else batch.images
    core = model.module if hasattr(model, "module") else model  # DDP wraps the WAP
    weight = float(getattr(core, "counting_weight", 0.0))
    guide = getattr(core, "guide", None)
    regions = getattr(batch, "regions", None)
    g_weight = guide_weight(guide, step) if regions is not None else 0.0
    s_weight = float(getattr(core, "symbol_map_weight", 0.0)) if regions is not None else 0.0
    if hasattr(core, "guide_value"):
        core.guide_value = None
        core.symbol_map_value = None
    with autocast(images.device, precision):
        if g_weight > 0 or s_weight > 0:
            logits, counts, alphas, symbols = model(
                images,
                batch.image_mask,
                batch.targets,
                batch.target_mask,
                with_counts=weight > 0,
                with_alphas=g_weight > 0,
                with_symbols=s_weight > 0,
            )
        else:
            out = model(images, batch.image_mask, batch.targets, batch.target_mask, with_counts=weight > 0)
            logits, counts = out if weight > 0 else (out, None)
    loss = sequence_loss(
        logits, batch.targets, batch.target_mask, float(getattr(core, "label_smoothing", 0.0))
    )
    if counts is not None:
        loss = loss + weight * counting_loss(counts, batch.targets, batch.target_mask)
    if g_weight > 0:
        g = guide_loss(alphas, regions, batch.target_mask, core.watcher.stride, guide["kind"])
        core.guide_value = g.detach()
        loss = loss + g_weight * g
    if s_weight > 0:
        m = symbol_map_loss(*symbols, regions, batch.targets, core.watcher.stride)
        core.symbol_map_value = m.detach()
        loss = loss + s_weight * m
    return fault.loss(loss, step) if fault else loss
