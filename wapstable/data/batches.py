"""The splits of the data source data.name (wapstable.data.sources), WAP-style size-bucketed batching, padding
masks, and the batch stream.

Batching follows the original WAP code: sort images by size, fill each batch while the padded batch stays under a
pixel budget and a maximum batch size, drop images over the budget and labels over `max_tokens`.
"""

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from wapstable.data.sample import Sample, Splits
from wapstable.data.schema import BucketBy
from wapstable.data.sources import source_of
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError

log = logging.getLogger(__name__)
SPLITS = ("train", "valid", "test")


class Batch(NamedTuple):
    images: torch.Tensor  # (B, 1, H, W) float in [0, 1], ink bright, padded with 0
    image_mask: torch.Tensor  # (B, H, W) float, 1 = real pixel
    targets: torch.Tensor  # (B, T) long, each label followed by <eol> = 0, padded with 0
    target_mask: torch.Tensor  # (B, T) float, 1 = real token (the <eol> included)
    ids: list[str]
    # (B, T, 4) float: the box of the symbol each target token names, x0, y0, x1, y1 in the batch's pixels; NaN
    # for <eol>, padding and tokens without ink; None when no sample of the batch has boxes (the attention guide)
    regions: torch.Tensor | None = None

    def to(self, device: torch.device) -> "Batch":
        regions = self.regions.to(device, non_blocking=True) if self.regions is not None else None
        return Batch(*(t.to(device, non_blocking=True) for t in self[:4]), self.ids, regions)


def load_splits(cfg_data, which: Sequence[str] = SPLITS, ink=None, source=None) -> Splits:
    """The samples of the data source `data._target_` names (or of `source`, read with `cfg_data`) by split; `which`
    splits to read (an evaluation needs one).

    With data.normalize, every image is brought to the ink `ink` (an InkStats: a checkpoint's), or for a new
    model to data.ink_stroke / data.ink_symbol (data/normalize.py)."""
    splits = (source or source_of(cfg_data)).splits(cfg_data, which)
    splits = splits if isinstance(splits, Splits) else Splits(splits)
    if cfg_data.get("normalize", False):
        from wapstable.data.normalize import InkStats, normalize

        target = ink or InkStats(float(cfg_data.ink_stroke), float(cfg_data.ink_symbol))
        height = int(cfg_data.get("height", 0) or 0)
        for split, samples in splits.items():
            splits[split] = [
                s._replace(image=normalize(s.image, target, height), boxes=None) for s in samples
            ]
        log.info("data.normalize: every image brought to %s", target)
    return splits


def by_test_set(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    """Test samples by named test set (the id's "SET/" prefix); samples without one form the set "test"."""
    sets: dict[str, list[Sample]] = {}
    for s in samples:
        name = s.id.split("/", 1)[0] if "/" in s.id else "test"
        sets.setdefault(name, []).append(s)
    return sets


def load_vocab(cfg_data, splits: dict[str, list[Sample]]) -> Vocab:
    """The dictionary file when the data set has one (WAP format), the CROHME 2014 dictionary for data=crohme and
    data.symbols=crohme, else every token of the data."""
    if not cfg_data.dictionary and (
        source_of(cfg_data).crohme_symbols or str(getattr(cfg_data, "symbols", "")) == "crohme"
    ):
        from wapstable.data.latex import crohme_vocab

        return crohme_vocab()
    if cfg_data.dictionary:
        path = Path(cfg_data.dictionary).expanduser()
        if not path.is_absolute() and cfg_data.root:
            path = Path(cfg_data.root).expanduser() / path
        if not path.is_file():
            raise UserError(
                f"data.dictionary={cfg_data.dictionary} does not exist; point it at a tok<TAB>index file"
            )
        try:
            return Vocab.load(path)
        except ValueError as e:
            raise UserError(f"data.dictionary: {e}") from None
    return Vocab.build(s.tokens for samples in splits.values() for s in samples)


def check_labels(samples: list[Sample], vocab: Vocab, on_error: str) -> list[Sample]:
    """Samples whose tokens are all in the vocabulary; an unknown token fails or is skipped per data.on_error."""
    kept = []
    for s in samples:
        try:
            vocab.encode(s.tokens, where=f"the label of sample {s.id}")
        except ValueError as e:
            if on_error == "fail":
                raise UserError(f"{e} (or set data.on_error=skip)") from None
            log.warning("skipping: %s", e)
            continue
        kept.append(s)
    return kept


def filter_samples(samples: list[Sample], max_image_pixels: int, max_tokens: int) -> list[Sample]:
    """Drop images over the pixel budget and labels over `max_tokens`, as WAP does, and say how many."""
    kept = [s for s in samples if s.image.size <= max_image_pixels and len(s.tokens) <= max_tokens]
    if len(kept) < len(samples):
        log.info(
            "dropped %d of %d samples over data.batch.max_image_pixels=%d or data.batch.max_tokens=%d",
            len(samples) - len(kept),
            len(samples),
            max_image_pixels,
            max_tokens,
        )
    return kept


BUCKETS = tuple(b.value for b in BucketBy)  # the schema's choices, for callers that pass a plain string


def check_bucket_by(bucket_by: str) -> None:
    """Refuse a data.batch.bucket_by that make_batches does not know, naming the options."""
    if bucket_by not in BUCKETS:
        raise UserError(f"data.batch.bucket_by={bucket_by!r} is unknown; use size (WAP's) or tokens")


def make_batches(
    samples: Sequence[Sample], pixel_budget: int, max_batch: int, bucket_by: str = "size"
) -> list[list[int]]:
    """Indices of samples grouped WAP-style: sorted, then each padded batch filled under `pixel_budget` pixels.

    bucket_by="size" sorts by image area, as WAP does. "tokens" sorts by label length, then image width: the
    parser runs once per token of a batch's longest label, so batches of equal lengths waste fewer decoding steps
    (on the default synthetic set about 30 % fewer), and since width grows with length, fewer padded pixels too.
    """
    check_bucket_by(bucket_by)

    def key(i: int) -> tuple:
        s = samples[i]
        if bucket_by == "tokens":
            return (len(s.tokens), s.image.shape[1], s.image.size, s.id)
        return (s.image.size, s.id)

    order = sorted(range(len(samples)), key=key)
    batches, current, max_h, max_w = [], [], 0, 0
    for i in order:
        h, w = samples[i].image.shape
        nh, nw = max(max_h, h), max(max_w, w)
        if current and (len(current) == max_batch or nh * nw * (len(current) + 1) > pixel_budget):
            batches.append(current)
            current, nh, nw = [], h, w
        current.append(i)
        max_h, max_w = nh, nw
    if current:
        batches.append(current)
    return batches


def collate(samples: Sequence[Sample], vocab: Vocab) -> Batch:
    """Pad images (with background 0) and labels (with <eol> 0) to the batch maximum, with masks."""
    b = len(samples)
    h = max(s.image.shape[0] for s in samples)
    w = max(s.image.shape[1] for s in samples)
    t = max(len(s.tokens) for s in samples) + 1  # + <eol>
    images = np.zeros((b, 1, h, w), dtype=np.float32)
    image_mask = np.zeros((b, h, w), dtype=np.float32)
    targets = np.zeros((b, t), dtype=np.int64)
    target_mask = np.zeros((b, t), dtype=np.float32)
    with_boxes = any(s.boxes is not None for s in samples)
    regions = np.full((b, t, 4), np.nan, dtype=np.float32) if with_boxes else None
    for k, s in enumerate(samples):
        sh, sw = s.image.shape
        images[k, 0, :sh, :sw] = s.image / 255.0
        image_mask[k, :sh, :sw] = 1.0
        ids = vocab.encode(s.tokens, where=f"the label of sample {s.id}")
        targets[k, : len(ids)] = ids
        target_mask[k, : len(ids) + 1] = 1.0
        if with_boxes and s.boxes is not None:
            regions[k, : len(ids)] = s.boxes  # images sit at the top left of the padded batch: same pixels
    return Batch(
        torch.from_numpy(images),
        torch.from_numpy(image_mask),
        torch.from_numpy(targets),
        torch.from_numpy(target_mask),
        [s.id for s in samples],
        torch.from_numpy(regions) if with_boxes else None,
    )


class _BatchDataset(Dataset):
    def __init__(self, samples: Sequence[Sample], batches: list[list[int]], vocab: Vocab):
        self.samples, self.batches, self.vocab = samples, batches, vocab

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Batch:
        return collate([self.samples[j] for j in self.batches[i]], self.vocab)


def _identity(x):
    return x


class BatchStream:
    """An endless, resumable stream of training batches.

    Epoch e visits the batches in an order drawn from (seed, e); with several ranks each takes every world-th
    batch of that order (trimmed to equal counts), so ranks never share a batch. `state_dict()` is the position
    (epoch, index within the epoch) of the next batch.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        vocab: Vocab,
        pixel_budget: int,
        max_batch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        bucket_by: str = "size",
        curriculum_epochs: int = 0,
    ):
        self.batches = make_batches(samples, pixel_budget, max_batch, bucket_by)
        # Curriculum: the first epochs visit batches from the shortest labels to the longest (a one-symbol image
        # needs no alignment, so the watcher learns its glyphs before the parser must learn to move).
        lengths = [max(len(samples[i].tokens) for i in b) for b in self.batches]
        self.by_length = sorted(range(len(self.batches)), key=lambda b: (lengths[b], b))
        self.curriculum_epochs = curriculum_epochs
        if len(self.batches) < world_size:
            raise UserError(
                f"the training split gives {len(self.batches)} batches for {world_size} processes"
            )
        self.dataset = _BatchDataset(samples, self.batches, vocab)
        self.seed, self.rank, self.world_size, self.num_workers = seed, rank, world_size, num_workers
        self.epoch, self.index = 0, 0
        self._iter = None

    def epoch_order(self, epoch: int) -> list[int]:
        if epoch < self.curriculum_epochs:
            order = np.asarray(self.by_length)
        else:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.batches))
        per_rank = len(order) // self.world_size
        return order[self.rank :: self.world_size][:per_rank].tolist()

    def __len__(self) -> int:
        return len(self.batches) // self.world_size

    def _start(self):
        order = self.epoch_order(self.epoch)[self.index :]
        loader = DataLoader(
            self.dataset,
            sampler=order,
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            timeout=120 if self.num_workers else 0,
            # its own generator: creating an iterator must not draw from the global RNG (dropout's), or a
            # resumed run would diverge from an uninterrupted one
            generator=torch.Generator().manual_seed(self.seed),
        )
        self._iter = iter(loader)

    def next(self) -> Batch:
        """The next batch; wraps to a new epoch order at the end of an epoch."""
        if self._iter is None:
            self._start()
        try:
            try:
                batch = next(self._iter)
            except StopIteration:
                self.epoch, self.index = self.epoch + 1, 0
                self._start()
                batch = next(self._iter)
        except RuntimeError as e:
            # A worker killed (out of memory, a segfault in a library) or stuck: the DataLoader's own message
            # names neither the setting nor what to try next.
            if not self.num_workers or "DataLoader" not in str(e):
                raise
            self._iter = None
            raise UserError(
                f"a data-loading worker failed ({e}) while reading training batch {self.index} of epoch "
                f"{self.epoch}; rerun with data.batch.num_workers=0 to see the error in the main process, or give "
                "the workers more memory (shared memory, /dev/shm, in a container)"
            ) from e
        self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._iter = None
