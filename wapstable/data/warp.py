"""A fresh random warp of every training image at every step (data.warp), its symbol boxes moved with it.

The rendered and CROHME images are drawn once and cached, so without it a model sees the same pixels of an
expression every epoch. Each image of a batch gets its own small affine warp (rotation, horizontal shear, a
shrink per axis, a shift) about its centre, inside its own extent: the padding stays exact zeros and the image
mask is unchanged. Boxes (Batch.regions) become the box around their warped corners. Draws come from torch's
global generator, which checkpoints save and resume restores, so a resumed run warps as the uninterrupted one.
"""

import math

import torch
import torch.nn.functional as F

from wapstable.data.batches import Batch


def _matrices(n: int, strength: float, generator: torch.Generator | None) -> torch.Tensor:
    """(n, 2, 2) linear parts M (output offset from the centre -> input offset): a rotation of up to 1.5 degrees,
    a horizontal shear of up to 0.15 and a shrink of each axis to 85-100 %, all scaled by `strength`."""
    u = torch.rand(n, 4, generator=generator) * 2 - 1  # in [-1, 1)
    angle = u[:, 0] * math.radians(1.5) * strength
    shear = u[:, 1] * 0.15 * strength
    # a shrink of the content: its input offsets are the output's divided by a scale <= 1
    sx = 1.0 - 0.075 * strength * (u[:, 2] + 1)
    sy = 1.0 - 0.075 * strength * (u[:, 3] + 1)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rot = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)  # (n, 2, 2)
    shr = torch.zeros(n, 2, 2)
    shr[:, 0, 0] = shr[:, 1, 1] = 1.0
    shr[:, 0, 1] = shear
    scale = torch.diag_embed(torch.stack([1 / sx, 1 / sy], -1))
    return scale @ shr @ rot


def warp_batch(batch: Batch, strength: float = 1.0, generator: torch.Generator | None = None) -> Batch:
    """`batch` with each image warped by its own random affine map about its centre (see the module's docstring),
    and its boxes with it; strength 0 returns the batch unchanged and draws nothing."""
    if strength <= 0:
        return batch
    images, mask = batch.images, batch.image_mask
    B = images.shape[0]
    lin = _matrices(B, strength, generator).to(images.device)
    shift = ((torch.rand(B, 2, generator=generator) * 2 - 1) * 2.0 * strength).to(images.device)  # px
    out = torch.zeros_like(images)
    regions = batch.regions.clone() if batch.regions is not None else None
    rows, cols = mask.amax(2), mask.amax(1)  # (B, H), (B, W): the image sits at the top left
    for i in range(B):
        h, w = int(rows[i].sum()), int(cols[i].sum())
        if h == 0 or w == 0:
            continue
        centre = torch.tensor([w / 2, h / 2], device=images.device)
        ys, xs = torch.meshgrid(
            torch.arange(h, device=images.device) + 0.5,
            torch.arange(w, device=images.device) + 0.5,
            indexing="ij",
        )
        p = torch.stack([xs, ys], -1) - centre  # (h, w, 2) output offsets
        q = p @ lin[i].T + centre + shift[i]  # input pixel coordinates
        grid = torch.stack([2 * q[..., 0] / w - 1, 2 * q[..., 1] / h - 1], -1)
        crop = images[i : i + 1, :, :h, :w].float()
        warped = F.grid_sample(crop, grid[None].to(crop.dtype), align_corners=False, padding_mode="zeros")
        out[i, :, :h, :w] = warped[0].to(images.dtype)
        if regions is not None:
            boxes = regions[i]  # (T, 4); NaN rows stay NaN
            corners = torch.stack(
                [boxes[:, [0, 1]], boxes[:, [2, 1]], boxes[:, [0, 3]], boxes[:, [2, 3]]], 1
            )  # (T, 4, 2)
            inv = torch.linalg.inv(lin[i])
            moved = (corners - centre - shift[i]) @ inv.T + centre
            lo, hi = moved.amin(1), moved.amax(1)
            lo = torch.stack([lo[:, 0].clamp(0, w), lo[:, 1].clamp(0, h)], -1)
            hi = torch.stack([hi[:, 0].clamp(0, w), hi[:, 1].clamp(0, h)], -1)
            regions[i] = torch.cat([lo, hi], -1)
    return batch._replace(images=out, regions=regions)
