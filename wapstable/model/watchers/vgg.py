"""WAP's VGG-FCN watcher (Zhang et al. 2017): `model.watcher._target_: wapstable.model.watchers.vgg.VGGWatcher`."""

from dataclasses import dataclass, field

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from wapstable.errors import UserError
from wapstable.model.watchers.masks import pool_mask


class VGGWatcher(nn.Module):
    """WAP's VGG-FCN watcher: blocks of conv3x3 + BN + ReLU, a 2x2 max-pool after each block (or, with
    `first_stride: 2`, the first conv strided 2 in place of the first block's pool)."""

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
        # 2: the first conv strided 2 in place of the first block's pool, so nothing runs at the input's full
        # resolution but that conv's output (the same stride; 0.81x the watcher's time: docs/benchmark.md)
        first_stride: int = 1

    def __init__(
        self,
        channels: list[int],
        convs_per_block: int = 2,
        block_convs: list[int] | None = None,
        pool_last: bool = True,
        first_stride: int = 1,
    ):
        super().__init__()
        if first_stride not in (1, 2):
            raise UserError(
                f"model.watcher.first_stride={first_stride} must be 1 (a 2x2 pool after the first block, as WAP) "
                "or 2 (the first conv strided in place of that pool)"
            )
        per_block = list(block_convs or []) or [convs_per_block] * len(channels)
        if not channels or len(per_block) != len(channels) or min(per_block) < 1:
            raise UserError(
                f"model.watcher.block_convs={per_block} must give one count of at least 1 per block of "
                f"model.watcher.channels={list(channels)}"
            )
        self.blocks = nn.ModuleList()
        cin = 1
        for i, (cout, n) in enumerate(zip(channels, per_block)):
            layers = nn.ModuleList()
            for j in range(n):
                stride = first_stride if i == j == 0 else 1
                # No conv bias: the BN right after has its own.
                layers.append(
                    nn.Sequential(
                        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout)
                    )
                )
                cin = cout
            self.blocks.append(layers)
        self.out_channels = cin
        # Without the last block's pool the annotations are twice as fine (stride 8 for 4 blocks), for small symbols.
        # A 2x2 ceil-mode pool after each block but the last (where pool_last) and the first (where its conv strides).
        last = len(channels) - 1
        self.pools = [
            not (i == last and not pool_last) and not (i == 0 and first_stride == 2) for i in range(last + 1)
        ]
        self.stride = first_stride * 2 ** sum(self.pools)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(B, 1, H, W) image and mask -> (B, C, h, w) features and (B, 1, h, w) mask."""
        for i, block in enumerate(self.blocks):
            for layer in block:
                x = layer(x)
                if layer[0].stride != (1, 1):  # the first conv, with first_stride=2
                    # A cell of the strided conv (centred on pixel 2k, covering 2k-1..2k+1) is valid where the 2x2 it
                    # strides over has a valid pixel: beyond the image it reads only the zeroed padding, as alone.
                    mask = pool_mask(mask)
                x = F.relu(x) * mask
            if self.pools[i]:
                # Post-ReLU values are >= 0, so the zeroed padding never wins the max.
                x = F.max_pool2d(x, 2, ceil_mode=True)
                mask = pool_mask(mask)
        return x, mask
