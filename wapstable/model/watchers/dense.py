"""DenseWAP's DenseNet watcher (Zhang et al. 2018): `model.watcher._target_:
wapstable.model.watchers.dense.DenseWatcher`."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from wapstable.errors import UserError
from wapstable.model.watchers.masks import masked_avg_pool, pool_mask


class DenseLayer(nn.Module):
    """DenseNet-BC bottleneck layer: BN-ReLU-conv1x1(4k)-BN-ReLU-conv3x3(k), its k maps appended to the input."""

    def __init__(self, cin: int, growth: int, dropout: float):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        y = self.conv1(F.relu(self.norm1(x)))  # (B, 4k, h, w); 1x1, so padding leaks nowhere yet
        y = self.conv2(F.relu(self.norm2(y)) * mask)  # (B, k, h, w)
        return torch.cat([x, self.drop(y) * mask], 1)


class DenseWatcher(nn.Module):
    """DenseWAP's watcher (Zhang et al. 2018): conv7x7/2 + max-pool, dense blocks, transitions between them."""

    @dataclass
    class Options:
        init_channels: int = 48
        growth: int = 24
        layers: int = 16  # bottleneck layers per dense block
        blocks: int = 3
        compression: float = 0.5  # channels kept by each transition
        dropout: float = 0.0  # inside the dense blocks

    def __init__(
        self,
        init_channels: int = 48,
        growth: int = 24,
        layers: int = 16,
        blocks: int = 3,
        compression: float = 0.5,
        dropout: float = 0.0,
    ):
        super().__init__()
        for key, value in (
            ("init_channels", init_channels),
            ("growth", growth),
            ("layers", layers),
            ("blocks", blocks),
        ):
            if value < 1:
                raise UserError(f"model.watcher.{key}={value} must be at least 1")
        if not 0 < compression <= 1 or not 0 <= dropout < 1:
            raise UserError(
                f"model.watcher.compression={compression} must lie in (0, 1] and model.watcher.dropout={dropout} "
                "in [0, 1)"
            )
        self.stem = nn.Conv2d(1, init_channels, 7, stride=2, padding=3, bias=False)
        self.stem_norm = nn.BatchNorm2d(init_channels)
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        c = init_channels
        for b in range(blocks):
            block = nn.ModuleList()
            for _ in range(layers):
                block.append(DenseLayer(c, growth, dropout))
                c += growth
            self.blocks.append(block)
            if b < blocks - 1:
                cout = int(c * compression)
                self.transitions.append(
                    nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, cout, 1, bias=False))
                )
                c = cout
        # A final BN + ReLU as torchvision's DenseNet (norm5): the concatenated maps are otherwise unnormalised.
        self.out_norm = nn.BatchNorm2d(c)
        self.out_channels = c  # paper sizes: 48 + 16*24 = 432 -> 216 + 384 = 600 -> 300 + 384 = 684
        self.stride = 4 * 2 ** (blocks - 1)  # stem conv /2, max-pool /2, one avg-pool per transition

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(B, 1, H, W) image and mask -> (B, C, h, w) features and (B, 1, h, w) mask."""
        # Output j of the stride-2 conv is centred on input 2j, so it is valid where that pixel is.
        mask = mask[:, :, ::2, ::2]
        x = F.relu(self.stem_norm(self.stem(x))) * mask
        x = F.max_pool2d(x, 2, ceil_mode=True)
        mask = pool_mask(mask)
        for b, block in enumerate(self.blocks):
            for layer in block:
                x = layer(x, mask)
            if b < len(self.transitions):
                x = masked_avg_pool(self.transitions[b](x), mask)
                mask = pool_mask(mask)
        return F.relu(self.out_norm(x)) * mask, mask
