"""Evaluation and inference from a checkpoint: rebuild the model, decode samples or image files, score them.

One evaluation path: the trainer's validation and test evaluations, `scripts/evaluate.py` and the tests all call
`evaluate_samples`, so a number in metrics.json and one printed by evaluate.py come from the same code.
"""

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from wapstable.checkpoint import inference_weights, load_checkpoint
from wapstable.config import Config, checkpoint_config
from wapstable.data.batches import collate, make_batches
from wapstable.data.normalize import InkStats, normalize, read_image  # noqa: F401 (read_image: the image-file API)
from wapstable.data.sample import Sample
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError
from wapstable.eval.metrics import ExpressionMetrics
from wapstable.model.decoding import beam_search, greedy_decode
from wapstable.model.wap import build_model

MARGIN = 4  # px of background kept around the ink, as the synthetic renderer and the InkML rasteriser keep


def load_model(
    ckpt_path: str | Path, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, Vocab, DictConfig]:
    """The model of a checkpoint (weights loaded, in eval mode, on `device`), its vocabulary and its config; the
    model's `ink_stats` is the InkStats of its training images (None for a checkpoint from before they were kept)."""
    if not Path(ckpt_path).is_file():
        raise UserError(
            f"checkpoint {ckpt_path} does not exist; give the path of a .pt file written by train.py"
        )
    state = load_checkpoint(ckpt_path)
    if not all(k in state for k in ("model", "vocab", "config")):
        raise UserError(
            f"{ckpt_path} has no model, vocabulary or config; give a checkpoint written by training"
        )
    vocab = Vocab(list(state["vocab"]))
    try:  # read as a resumed run reads it: onto this version's schema, older keys mapped
        cfg = checkpoint_config(dict(state["config"]), [], OmegaConf.structured(Config))
    except Exception as e:  # noqa: BLE001  (OmegaConf's errors, or a config of another program)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"{ckpt_path}: its config does not fit this version's ({first}); give a checkpoint written by train.py"
        ) from None
    model = build_model(cfg.model, len(vocab))
    try:
        model.load_state_dict(inference_weights(state))
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        raise UserError(f"{ckpt_path}: its weights do not fit its own model config ({first})") from None
    model.ink_stats = InkStats.from_dict(state.get("ink_stats"))
    return model.to(device).eval(), vocab, cfg


def decode(
    model,
    images,
    image_mask,
    beam_size: int,
    max_len: int,
    return_attention: bool = False,
    scores_out: list | None = None,
    length_power: float = 1.0,
):
    """Greedy for beam_size 1, else beam search: token indices per image (and attention maps if asked; each pick's
    log-prob / length ** length_power into `scores_out` if given)."""
    if beam_size > 1:
        return beam_search(
            model,
            images,
            image_mask,
            beam_size,
            max_len,
            return_attention=return_attention,
            scores_out=scores_out,
            length_power=length_power,
        )
    return greedy_decode(
        model,
        images,
        image_mask,
        max_len,
        return_attention=return_attention,
        scores_out=scores_out,
        length_power=length_power,
    )


def rescale(images: Tensor, image_mask: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    """A batch's images and mask resized by `factor` (bilinear, antialiased when shrinking; the mask by nearest
    neighbour), at least 16 px each way: the batch as if its ink had been drawn `factor` times as large."""
    if factor == 1.0:
        return images, image_mask
    H, W = images.shape[-2:]
    size = (max(16, round(H * factor)), max(16, round(W * factor)))
    out = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=factor < 1)
    mask = F.interpolate(image_mask.unsqueeze(1), size=size, mode="nearest").squeeze(1)
    return out.clamp(0, 1) * mask.unsqueeze(1), mask


def check_scales(scales) -> None:
    """decode.scales: one or more finite factors, each in (0.25, 4]; else a UserError naming the value."""
    try:
        values = [float(v) for v in scales]
    except (TypeError, ValueError):
        values = []
    if not values or not all(0.25 < v <= 4.0 for v in values):  # NaN fails too
        shown = list(scales) if hasattr(scales, "__iter__") and not isinstance(scales, str) else scales
        raise UserError(
            f"decode.scales={shown} must list one or more "
            "factors in (0.25, 4], e.g. decode.scales=[1.0] (each image as it is) or decode.scales=[1.0,0.85,0.7]"
        )


def check_length_power(value) -> None:
    """decode.length_power: a number in [0, 2]; else a UserError naming the value."""
    if not 0.0 <= float(value) <= 2.0:  # NaN fails too
        raise UserError(
            f"decode.length_power={value} must be in [0, 2]: 1 divides each reading's log-prob by its length "
            "(as WAP), 0 not at all"
        )


def decode_scales(
    model,
    images,
    image_mask,
    beam_size: int,
    max_len: int,
    scales: Sequence[float] = (1.0,),
    length_power: float = 1.0,
):
    """Token indices per image, read at every scale of `scales` (decode.scales, test-time): for each image, the
    reading whose log-prob / length ** length_power is highest. One scale (the default, 1) is plain `decode`."""
    if len(scales) == 1 and scales[0] == 1.0:
        return decode(model, images, image_mask, beam_size, max_len, length_power=length_power)
    best: list[tuple[float, list[int]]] = []
    for factor in scales:
        scores: list[float] = []
        x, m = rescale(images, image_mask, float(factor))
        seqs = decode(model, x, m, beam_size, max_len, scores_out=scores, length_power=length_power)
        if not best:
            best = list(zip(scores, seqs))
        else:
            best = [b if b[0] >= sc else (sc, q) for b, sc, q in zip(best, scores, seqs)]
    return [seq for _, seq in best]


@torch.no_grad()
def evaluate_samples(
    model,
    vocab: Vocab,
    samples: Sequence[Sample],
    beam_size: int,
    max_len: int,
    pixel_budget: int,
    max_batch: int,
    device: torch.device | str,
    loss_fn: Callable | None = None,
    predictions: list | None = None,
    scales: Sequence[float] = (1.0,),
    length_power: float = 1.0,
) -> dict:
    """Decode every sample in WAP-style batches and score it: ExpressionMetrics.compute()'s dict.

    `loss_fn(model, batch)`, when given, is the teacher-forced loss of a batch; its sample-weighted mean is added as
    result["loss"]. `predictions`, when given, receives one dict per sample: its id, reference and predicted tokens
    and their edit distance. `scales` (decode.scales) reads every image at each of those scales and keeps the most
    likely reading (`decode_scales`), each reading's log-prob divided by its length ** `length_power`
    (decode.length_power). The model is put in eval mode for the evaluation and back in its former mode
    after.
    """
    was_training = model.training
    model.eval()
    metrics = ExpressionMetrics()
    total_loss = 0.0
    try:
        for idx in make_batches(samples, pixel_budget, max_batch):
            batch = collate([samples[i] for i in idx], vocab).to(device)
            if loss_fn is not None:
                total_loss += float(loss_fn(model, batch)) * len(idx)
            hyps = decode_scales(
                model, batch.images, batch.image_mask, beam_size, max_len, scales, length_power
            )
            preds = [vocab.decode(h) for h in hyps]
            refs = [samples[i].tokens for i in idx]
            distances = metrics.update(preds, refs)
            if predictions is not None:
                for i, pred, ref, edits in zip(idx, preds, refs, distances):
                    predictions.append(
                        {"id": samples[i].id, "truth": list(ref), "prediction": pred, "errors": edits}
                    )
    finally:
        model.train(was_training)
    result = metrics.compute()
    if loss_fn is not None:
        result["loss"] = total_loss / max(1, len(samples))
    return result


def score_test_sets(evaluate: Callable[[list[Sample]], dict], samples: Sequence[Sample], sizes: dict) -> dict:
    """Each named test set's metrics (`evaluate(samples)` of its samples), over all of its expressions.

    `sizes` gives a set's expression count as published (its files); an expression that could not be read or
    normalised counts as wrong, so ExpRate and the within-k figures are over `total`, as the papers report them;
    `read` is how many were evaluated and `exprate_read` the ExpRate over those; WER is over the read ones.
    """
    from wapstable.data.batches import by_test_set

    out = {}
    for name, group in by_test_set(samples).items():
        r = evaluate(group)
        read = r["count"]
        total = max(int(sizes.get(name, read)), read)
        row = {"total": total, "read": read, "exprate_read": r["exprate"]}
        for key in ("exprate", "within_1", "within_2", "within_3"):
            row[key] = r[key] * read / max(total, 1)
        out[name] = {**r, **row}
    return out


def combine_sets(sets: dict) -> dict:
    """One row over several scored test sets (their expressions together)."""
    total = sum(r["total"] for r in sets.values())
    row = {"total": total, "read": sum(r["read"] for r in sets.values())}
    for key in ("exprate", "within_1", "within_2", "within_3"):
        row[key] = sum(r[key] * r["total"] for r in sets.values()) / max(total, 1)
    edits = sum(r["wer"] * r.get("ref_tokens", 0) for r in sets.values())
    tokens = sum(r.get("ref_tokens", 0) for r in sets.values())
    row["wer"] = edits / max(tokens, 1)
    return row


# -----------------------------------------------------------------------------
# image files


def prepare_image(
    gray: np.ndarray,
    invert: str = "auto",
    height: int | None = None,
    max_pixels: int | None = None,
    ink: InkStats | None = None,
):
    """A gray image in the training convention: ink bright on 0, cropped to the ink plus a margin, scaled.

    With `ink` (a checkpoint's InkStats) and no `height`, the image is brought to that ink (data/normalize.py:
    polarity, contrast, symbol size and pen width), then shrunk to `max_pixels` if larger. Without it:

    invert: "auto" inverts when the background (the median pixel: ink is sparse) is bright, as for a scan or a
    rendering of dark ink on white; "yes" / "no" force it. The background level is then subtracted and the
    contrast stretched, so a gray scan background becomes the 0 the model was trained on. `height` scales the
    cropped image (margin included) to that many rows; `max_pixels` shrinks a larger image to fit (the trainer
    drops training images over data.batch.max_image_pixels, so the model never saw bigger ones).
    """
    if invert not in ("auto", "yes", "no"):
        raise UserError(f"invert={invert!r} is unknown; use auto, yes or no")
    if ink is not None and not height:
        if float(gray.max()) - float(gray.min()) < 16:
            raise UserError("the image has no ink: it is one flat colour")
        x = 255 - gray if invert == "yes" else gray
        x = normalize(x, ink, polarity="auto" if invert == "auto" else "bright").astype(np.float32)
        return shrink(x, max_pixels)
    x = gray.astype(np.float32)
    if invert == "yes" or (invert == "auto" and np.median(x) > 127):
        x = 255.0 - x
    background, peak = float(np.median(x)), float(x.max())
    if peak - background < 16:
        raise UserError("the image has no ink: it is one flat colour")
    x = np.clip((x - background) / (peak - background), 0.0, 1.0) * 255.0
    x[x < 32] = 0  # paper texture and JPEG noise would otherwise widen the crop and read as faint strokes
    rows, cols = np.flatnonzero(x.any(1)), np.flatnonzero(x.any(0))
    x = np.pad(x[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1], MARGIN)
    return shrink(x, max_pixels, height)


def shrink(x: np.ndarray, max_pixels: int | None, height: int | None = None) -> np.ndarray:
    """(H, W) float image scaled to `height` rows when given, and shrunk to at most `max_pixels`; as uint8."""
    h, w = x.shape
    scale = height / h if height else 1.0
    if max_pixels and h * w * scale * scale > max_pixels:
        scale = math.sqrt(max_pixels / (h * w))
    if scale != 1.0:
        from PIL import Image

        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        x = np.asarray(Image.fromarray(x.astype(np.uint8)).resize(size, Image.Resampling.LANCZOS), np.float32)
    return np.clip(x, 0, 255).round().astype(np.uint8)


@torch.no_grad()
def predict_image(model, image: np.ndarray, beam_size: int, max_len: int) -> tuple[list[int], np.ndarray]:
    """Decode one prepared (H, W) uint8 image alone: token indices and their attention maps (T, h, w)."""
    device = next(model.parameters()).device
    x = torch.from_numpy(image.astype(np.float32) / 255.0)[None, None].to(device)
    mask = torch.ones(1, *image.shape, device=device)
    model.eval()
    seqs, maps = decode(model, x, mask, beam_size, max_len, return_attention=True)
    return seqs[0], maps[0].float().cpu().numpy()
