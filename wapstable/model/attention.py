"""WAP's coverage attention and the masked softmax whose naive form made a WAP run die of NaN.

The failure: the original WAP code computes `alpha = exp(e) * mask; alpha / alpha.sum()` with no max subtraction.
e = 92 already overflows float32 (limit about e^88.7; float16 about e^11.1), and then inf * 0 or inf / inf is NaN.
`masked_softmax(stable=True)` subtracts the per-row max over valid positions first (softmax is shift-invariant).
"""

import math

import torch
import torch.nn as nn
from torch import Tensor


def grid_positions(h: int, w: int, channels: int, device=None, dtype=torch.float32) -> Tensor:
    """2-D sinusoidal features of an h x w grid, (h*w, channels): half for the row, half for the column.

    Frequencies fall geometrically from 1 to about 1/100 cycles per cell, so neighbouring cells differ and a wide
    expression's left and right ends do too. Positions count from the top-left cell, where every image starts.
    """
    if channels % 4:
        raise ValueError(f"model.attention.position_features must be a multiple of 4 (got {channels})")
    n = channels // 4
    freq = torch.exp(torch.arange(n, device=device, dtype=torch.float32) * (-math.log(100.0) / max(n - 1, 1)))
    ys = torch.arange(h, device=device, dtype=torch.float32)[:, None] * freq  # (h, n)
    xs = torch.arange(w, device=device, dtype=torch.float32)[:, None] * freq  # (w, n)
    row = torch.cat([ys.sin(), ys.cos()], -1)[:, None].expand(h, w, 2 * n)
    col = torch.cat([xs.sin(), xs.cos()], -1)[None].expand(h, w, 2 * n)
    return torch.cat([row, col], -1).reshape(h * w, channels).to(dtype)


def masked_softmax(energy: Tensor, mask: Tensor, stable: bool = True, dim: int = -1) -> Tensor:
    """Softmax of `energy` over the positions where `mask` is set; padding gets exactly 0.

    stable=False is the original WAP formula, kept to reproduce its overflow on purpose.
    A fully masked row gives all zeros in the stable form (NaN, 0/0, in the naive one).
    """
    if not stable:
        # Left in the input dtype on purpose: float16 must overflow where the original code did (e > 11.1).
        alpha = torch.exp(energy) * mask.to(energy.dtype)
        return alpha / alpha.sum(dim, keepdim=True)
    # float16/bfloat16 are upcast: a sum over thousands of positions loses digits in them, and torch.softmax
    # under autocast runs in float32 too; the result is cast back so callers see their own dtype.
    x = energy.float() if energy.dtype in (torch.float16, torch.bfloat16) else energy
    valid = mask.bool()
    # torch.softmax subtracts the row maximum before exp (the log-sum-exp trick) in one fused kernel, which is as
    # fast as the naive formula. Padding is filled with the dtype's min, not -inf: a fully masked row then gives a
    # finite uniform row (not (-inf) - (-inf) = NaN), which the mask turns into zeros; with any valid position,
    # exp(min - max) underflows to exactly 0, so the max is the one over valid positions.
    alpha = torch.softmax(x.masked_fill(~valid, torch.finfo(x.dtype).min), dim) * valid.to(x.dtype)
    return alpha.to(energy.dtype)


class CoverageAttention(nn.Module):
    """WAP coverage attention (Zhang et al. 2017): e_ti = v^T tanh(W h + U a_i + U_f f_i).

    f = Q * (sum of past alphas) is a conv over the coverage map, so the parser knows what it already read.
    """

    def __init__(
        self,
        query_dim: int,
        feat_dim: int,
        dim: int,
        coverage_channels: int,
        coverage_kernel: int,
        stable: bool = True,
        position_features: int = 0,
    ):
        super().__init__()
        if coverage_kernel % 2 != 1:
            raise ValueError(
                f"model.attention.coverage_kernel must be odd (got {coverage_kernel}) so the coverage conv "
                "keeps the feature map's size"
            )
        self.feat_proj = nn.Linear(feat_dim, dim)  # U (with the one bias of the sum)
        self.position_features = position_features
        if position_features:
            grid_positions(1, 1, position_features)  # a bad size fails here, at build time
            self.pos_proj = nn.Linear(position_features, dim, bias=False)  # P
        self.query_proj = nn.Linear(query_dim, dim, bias=False)  # W
        k = coverage_kernel
        self.coverage_conv = nn.Conv2d(1, coverage_channels, k, padding=k // 2)  # Q
        self.coverage_proj = nn.Linear(coverage_channels, dim, bias=False)  # U_f
        # No bias on v: softmax is shift-invariant, a bias there would get zero gradient.
        self.v = nn.Linear(dim, 1, bias=False)
        self.stable = stable
        # Fault-injection hook: 1e4 makes the naive softmax overflow, reproducing the overflow end to end.
        self.energy_scale = 1.0

    def project_features(self, features: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """U a_i (+ P pos_i) for every position, once per image rather than once per decoding step:
        (B, L, C) -> (B, L, A); `grid` = (h, w) with L = h*w, needed when position features are on."""
        proj = self.feat_proj(features)
        if self.position_features:
            if grid is None:
                raise ValueError("project_features needs the grid (h, w) when position features are on")
            pos = grid_positions(*grid, self.position_features, features.device, proj.dtype)
            proj = proj + self.pos_proj(pos)
        return proj

    def forward(
        self, query: Tensor, features: Tensor, proj: Tensor, mask: Tensor, coverage: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Context (B, C) and attention (B, h, w) for query (B, Hq), features (B, L, C), proj (B, L, A),
        mask (B, h, w) and coverage (B, h, w) = the sum of the past steps' alphas."""
        B, h, w = coverage.shape
        cov = self.coverage_conv(coverage.unsqueeze(1))  # (B, Cq, h, w)
        cov = self.coverage_proj(cov.flatten(2).transpose(1, 2))  # (B, L, A)
        energy = self.v(torch.tanh(proj + self.query_proj(query).unsqueeze(1) + cov)).squeeze(-1)  # (B, L)
        # (B, L); the exp stays in this module's forward so the NaN localiser names it (and ExpBackward0).
        if self.energy_scale != 1.0:
            energy = energy * self.energy_scale
        alpha = masked_softmax(energy, mask.reshape(B, h * w), stable=self.stable)
        context = torch.bmm(alpha.unsqueeze(1).to(features.dtype), features).squeeze(1)  # (B, C)
        return context, alpha.view(B, h, w)
