"""The masks of a watcher's pools: padding stays invisible to the output (see wapstable/model/wap.py)."""

import torch.nn.functional as F
from torch import Tensor


def pool_mask(mask: Tensor) -> Tensor:
    """The mask after a 2x2 ceil-mode pool: a cell is valid if any of its pixels is. (B, 1, H, W) -> (B, 1, h, w)"""
    return F.max_pool2d(mask, 2, ceil_mode=True)


def masked_avg_pool(x: Tensor, mask: Tensor) -> Tensor:
    """2x2 average over valid pixels only, so a border cell half in the padding averages what the image alone has."""
    total = F.avg_pool2d(x * mask, 2, ceil_mode=True, divisor_override=1)  # (B, C, h, w)
    count = F.avg_pool2d(mask, 2, ceil_mode=True, divisor_override=1)  # (B, 1, h, w)
    return total / count.clamp_min(1.0)
