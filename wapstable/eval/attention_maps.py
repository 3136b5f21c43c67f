"""Attention maps drawn on the image: one picture for TensorBoard at each evaluation, for
`scripts/predict.py --attention` and for `make figures`.

A grid of panels: the input, then one panel per decoded token with the attention that emitted it tinted over the
ink. Drawn with numpy and PIL, not matplotlib, because an evaluation should not wait on figures (a few ms a
picture, not half a second).
"""

import math
from pathlib import Path

import numpy as np
import torch


def upsample_attention(att: np.ndarray, stride: int, size: tuple[int, int]) -> np.ndarray:
    """Attention maps (T, h, w) on the feature grid as (T, H, W) maps on the image's pixels.

    Cell (i, j) sees pixels [i*stride, (i+1)*stride) x [j*stride, (j+1)*stride); the pools round up, so the last
    cells may reach past the image and are cut off. Bilinear, so that a peak reads as a blob, not a block.
    """
    gh, gw = att.shape[1:]
    t = torch.as_tensor(att, dtype=torch.float32)[:, None]
    up = torch.nn.functional.interpolate(
        t, size=(gh * stride, gw * stride), mode="bilinear", align_corners=False
    )
    return up[:, 0, : size[0], : size[1]].numpy()


def attention_image(
    image: np.ndarray,
    att: np.ndarray,
    stride: int,
    pred: list[str],
    truth: list[str] | None = None,
    title: str | None = None,
    max_tokens: int | None = None,
) -> np.ndarray:
    """An RGB uint8 (H', W', 3) grid: the input, then each decoded token's attention over it, captioned.

    `image` (h, w) is what the model read, ink bright (uint8 0..255 or float 0..1; a padded batch image may be
    larger: it is cropped to the attention's reach); `att` (T, gh, gw) is on the watcher's feature grid of stride
    `stride`. The image is drawn as dark ink on white; each map is scaled to its own peak, so every panel shows where
    that step looked, however spread out its attention is. `pred` names the tokens; `truth` and `title` go on top.
    """
    from matplotlib import colormaps
    from PIL import Image, ImageDraw

    gray = np.asarray(image, dtype=np.float32)
    if gray.max(initial=0.0) > 1.0:
        gray = gray / 255.0
    h, w = gray.shape
    paper = np.repeat(1.0 - np.clip(gray, 0.0, 1.0)[..., None], 3, 2)  # (h, w, 3)
    T = len(att) if max_tokens is None else min(len(att), max_tokens)
    panels = [(paper, "input")]
    if T:
        maps = upsample_attention(att[:T], stride, (h, w))
        peak = np.maximum(maps.max((1, 2), keepdims=True), 1e-12)
        a = (maps / peak)[..., None]  # (T, h, w, 1) in [0, 1]
        heat = colormaps["plasma"](a[..., 0])[..., :3]
        tinted = (1 - 0.75 * a) * paper[None] + 0.75 * a * heat  # the attention tints where it is
        for t in range(T):
            token = pred[t] if t < len(pred) else "<eol>"
            panels.append((tinted[t], f"{t + 1}: {token}"))
    scale = max(1, min(4, 80 // max(h, 1)))  # small renderings are enlarged to stay readable
    ph, pw, cap, pad = h * scale, w * scale, 14, 4
    ncols = max(1, min(len(panels), 3 if w / h < 4 else 2))
    nrows = math.ceil(len(panels) / ncols)
    width = max(ncols * (pw + pad) + pad, 320)
    header = [line for line in (title, f"pred:  {' '.join(pred) or '(empty)'}") if line]
    if truth is not None:
        header.append(f"truth: {' '.join(truth)}")
    chars = max(20, width // 6)
    header = [line[i : i + chars] for line in header for i in range(0, max(len(line), 1), chars)]
    top = pad + 12 * len(header)
    canvas = np.full((top + nrows * (ph + cap + pad), width, 3), 255, np.uint8)
    for k, (panel, _) in enumerate(panels):
        y = top + (k // ncols) * (ph + cap + pad) + cap
        x = pad + (k % ncols) * (pw + pad)
        canvas[y : y + ph, x : x + pw] = (np.kron(panel, np.ones((scale, scale, 1))) * 255).astype(np.uint8)
    out = Image.fromarray(canvas)
    draw = ImageDraw.Draw(out)
    for i, line in enumerate(header):
        draw.text((pad, pad + 12 * i), line, fill=(0, 0, 0))
    for k, (_, caption) in enumerate(panels):
        y = top + (k // ncols) * (ph + cap + pad)
        draw.text((pad + (k % ncols) * (pw + pad), y + 1), caption, fill=(150, 40, 0))
    return np.asarray(out)


def save_attention_image(path: str | Path, *args, **kwargs) -> Path:
    """`attention_image(*args, **kwargs)` written to `path` as a PNG."""
    from PIL import Image

    path = Path(path)
    Image.fromarray(attention_image(*args, **kwargs)).save(path)
    return path


@torch.no_grad()
def attention_pictures(model, samples, vocab, max_len: int) -> list[np.ndarray]:
    """The samples decoded greedily in one batch, each drawn with its attention and its true label."""
    from wapstable.data.batches import collate
    from wapstable.model.decoding import greedy_decode

    batch = collate(samples, vocab).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        seqs, maps = greedy_decode(model, batch.images, batch.image_mask, max_len, return_attention=True)
    finally:
        model.train(was_training)
    images = batch.images[:, 0].float().cpu().numpy()
    stride = model.watcher.stride
    pictures = []
    for i, sample in enumerate(samples):
        h, w = sample.image.shape
        pred = vocab.decode(seqs[i])
        att = maps[i].float().cpu().numpy()
        pictures.append(
            attention_image(images[i][:h, :w], att, stride, pred, truth=sample.tokens, max_tokens=11)
        )
    return pictures
