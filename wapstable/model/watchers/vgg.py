"""WAP's VGG-FCN watcher (Zhang et al. 2017): `model.watcher._target_: wapstable.model.watchers.vgg.VGGWatcher`."""

from dataclasses import dataclass, field

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from wapstable.errors import UserError
from wapstable.model.watchers.masks import pool_mask


class VGGWatcher(nn.Module):
    """WAP's VGG-FCN watcher: blocks of conv3x3 + BN + ReLU, a 2x2 max-pool after each block."""

    @dataclass
    class Options:
        # len(channels) blocks of `convs_per_block` conv3x3 + BN + ReLU, then a 2x2 max-pool
        channels: list[int] = field(default_factory=lambda: [16, 32, 48, 64])
        convs_per_block: int = 2
        block_convs: list[int] = field(
            default_factory=list
        )  # convs in each block; empty = convs_per_block each
        # false: no pool after the last block, annotations at half the stride (8 for 4 blocks)
        pool_last: bool = True

    def __init__(
        self,
        channels: list[int],
        convs_per_block: int = 2,
        block_convs: list[int] | None = None,
        pool_last: bool = True,
    ):
        super().__init__()
        per_block = list(block_convs or []) or [convs_per_block] * len(channels)
        if not channels or len(per_block) != len(channels) or min(per_block) < 1:
            raise UserError(
                f"model.watcher.block_convs={per_block} must give one count of at least 1 per block of "
                f"model.watcher.channels={list(channels)}"
            )
        self.blocks = nn.ModuleList()
        cin = 1
        for cout, n in zip(channels, per_block):
            layers = nn.ModuleList()
            for _ in range(n):
                # No conv bias: the BN right after has its own.
                layers.append(
                    nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))
                )
                cin = cout
            self.blocks.append(layers)
        self.out_channels = cin
        # Without the last block's pool the annotations are twice as fine (stride 8 for 4 blocks), for small symbols.
        self.pool_last = pool_last
        self.stride = 2 ** (len(channels) - (0 if pool_last else 1))

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(B, 1, H, W) image and mask -> (B, C, h, w) features and (B, 1, h, w) mask."""
        for i, block in enumerate(self.blocks):
            for layer in block:
                x = F.relu(layer(x)) * mask
            if i == len(self.blocks) - 1 and not self.pool_last:
                break
            # Post-ReLU values are >= 0, so the zeroed padding never wins the max.
            x = F.max_pool2d(x, 2, ceil_mode=True)
            mask = pool_mask(mask)
        return x, mask
