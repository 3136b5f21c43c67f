"""Fresh pixel augmentation of every training batch (data.pixel_aug), so that a model does not learn one pen.

The project's rasterisers draw every training image with one pen at one scale, and a model trained on them reads
little else (a 1-px or 4-px pen, or ink 1.3 times as large, costs it most of its ExpRate). Per step:

- scale: the whole batch resized by one factor drawn log-uniformly from `scale` (CoMER draws 0.7 to 1.4), its
  mask and symbol boxes with it;
- pen: with chance `pen`, an image's strokes thinned by one px or thickened by one or two (min / max filters);
- blur: with chance `blur`, an image blurred (Gaussian, sigma 0.3 to 1.2 px), as a scan or a resampling blurs;
- binarize: with chance `binarize`, an image thresholded at a level drawn from 0.25 to 0.75.

Draws come from torch's global generator, which checkpoints save, so a resumed run augments as the uninterrupted
one; the augmented batch is what an anomaly checkpoint stores.
"""

import math

import torch
import torch.nn.functional as F
from torchvision.transforms.functional import gaussian_blur

from wapstable.data.batches import Batch
from wapstable.errors import UserError


def check_pixel_aug(aug) -> None:
    """data.pixel_aug: scale [lo, hi] with 0.25 <= lo <= hi <= 4, chances in [0, 1]; else one sentence."""
    scale = list(aug.scale) if aug.scale is not None else []
    if len(scale) != 2 or not 0.25 <= float(scale[0]) <= float(scale[1]) <= 4.0:
        raise UserError(
            f"data.pixel_aug.scale={scale} must be [lo, hi] with 0.25 <= lo <= hi <= 4, "
            "e.g. data.pixel_aug.scale=[0.7,1.4] (or [1,1] for none)"
        )
    for key in ("pen", "blur", "binarize"):
        value = float(aug[key])
        if not 0.0 <= value <= 1.0:  # NaN fails too
            raise UserError(f"data.pixel_aug.{key}={aug[key]} must be a chance in [0, 1] (0 turns it off)")


def active(aug) -> bool:
    """Whether `data.pixel_aug` changes anything."""
    if aug is None:
        return False
    lo, hi = (float(v) for v in aug.scale)
    return (lo, hi) != (1.0, 1.0) or any(float(aug[k]) > 0 for k in ("pen", "blur", "binarize"))


def _drawn(chance: float, n: int) -> torch.Tensor:
    """(n,) bool: which images of the batch get an augmentation of this chance."""
    return torch.rand(n) < chance


def _pick(chance: float, n: int, device) -> torch.Tensor:
    """_drawn as an (n, 1, 1, 1) mask on the batch's device."""
    return _drawn(chance, n).view(n, 1, 1, 1).to(device)


def _thin(x: torch.Tensor) -> torch.Tensor:  # a 2x2 min filter: a stroke one px thinner
    return -F.max_pool2d(F.pad(-x, (0, 1, 0, 1)), 2, stride=1)


def _thick(x: torch.Tensor, k: int) -> torch.Tensor:  # a k x k max filter: a stroke k - 1 px thicker
    return F.max_pool2d(F.pad(x, (0, k - 1, 0, k - 1)), k, stride=1)


def augment_batch(
    batch: Batch, scale=(1.0, 1.0), pen: float = 0.0, blur: float = 0.0, binarize: float = 0.0
) -> Batch:
    """`batch` with the augmentations of the module's docstring; with their defaults it is returned unchanged and
    nothing is drawn."""
    images, mask, regions = batch.images, batch.image_mask, batch.regions
    lo, hi = float(scale[0]), float(scale[1])
    if hi > lo or lo != 1.0:
        u = float(torch.rand(()))
        factor = math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
        H, W = images.shape[-2:]
        size = (max(16, round(H * factor)), max(16, round(W * factor)))
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=factor < 1)
        mask = F.interpolate(mask.unsqueeze(1), size=size, mode="nearest").squeeze(1)
        images = images.clamp(0, 1) * mask.unsqueeze(1)
        if regions is not None:
            regions = regions * torch.tensor([size[1] / W, size[0] / H] * 2, device=regions.device)
    n, device = images.shape[0], images.device
    if pen > 0:
        way = torch.randint(0, 3, (n,))  # thinner, 1 px thicker, 2 px thicker
        picked = _drawn(pen, n)
        if picked.any():  # each picked image filtered the one way drawn for it, the others untouched
            images = images.clone()
            for w, change in enumerate((_thin, lambda x: _thick(x, 2), lambda x: _thick(x, 3))):
                rows = (picked & (way == w)).nonzero().flatten().to(device)
                if len(rows):
                    images[rows] = change(images[rows]) * mask[rows].unsqueeze(1)
    if blur > 0:
        sigma = 0.3 + 0.9 * float(torch.rand(()))
        rows = _drawn(blur, n).nonzero().flatten().to(device)
        if len(rows):
            images = images.clone()
            blurred = gaussian_blur(images[rows], kernel_size=[5, 5], sigma=[sigma, sigma])
            images[rows] = blurred * mask[rows].unsqueeze(1)
    if binarize > 0:
        level = (0.25 + 0.5 * torch.rand(n)).view(n, 1, 1, 1).to(device)
        images = torch.where(_pick(binarize, n, device), (images > level).to(images.dtype), images)
    return batch._replace(images=images.contiguous(), image_mask=mask.contiguous(), regions=regions)
