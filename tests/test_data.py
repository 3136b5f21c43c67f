"""Vocabulary files, WAP-style batching under a pixel budget, padding masks, and the resumable batch stream."""

import numpy as np
import pytest

from wapstable.data.batches import BatchStream, collate, make_batches
from wapstable.data.sample import Sample
from wapstable.data.vocab import Vocab


def samples(n=40, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = int(rng.integers(10, 40)), int(rng.integers(20, 120))
        img = (rng.random((h, w)) > 0.7).astype(np.uint8) * 255
        out.append(Sample(f"s{i}", img, ["x", "+", str(i % 10)][: 1 + i % 3]))
    return out


def test_vocab_roundtrip_and_eol_first(tmp_path):
    vocab = Vocab.build([["b", "a"], ["\\frac", "{", "a", "}"]])
    assert vocab.tokens[0] == "<eol>" and len(vocab) == 6
    vocab.save(tmp_path / "vocab.txt")
    assert (tmp_path / "vocab.txt").read_text().splitlines()[0] == "<eol>\t0"
    assert Vocab.load(tmp_path / "vocab.txt") == vocab
    assert vocab.decode(vocab.encode(["a", "b"]) + [0, 3]) == ["a", "b"]
    with pytest.raises(ValueError, match="'zeta'"):
        vocab.encode(["zeta"])


def test_batches_respect_budget_and_cover_everything():
    data = samples()
    batches = make_batches(data, pixel_budget=6000, max_batch=4)
    assert sorted(i for b in batches for i in b) == list(range(len(data)))
    for b in batches:
        h = max(data[i].image.shape[0] for i in b)
        w = max(data[i].image.shape[1] for i in b)
        assert len(b) <= 4
        assert len(b) == 1 or h * w * len(b) <= 6000
    sizes = [data[b[0]].image.size for b in batches]
    assert sizes == sorted(sizes)  # sorted by size, as WAP does


def test_token_buckets_cut_decoding_steps():
    # Labels of 1..12 tokens whose length is unrelated to the image size: sorting by size mixes lengths.
    rng = np.random.default_rng(1)
    data = [
        Sample(
            f"s{i}",
            np.full((int(rng.integers(10, 40)), int(rng.integers(20, 120))), 255, np.uint8),
            ["x"] * n,
        )
        for i, n in enumerate(rng.integers(1, 13, 60))
    ]

    def decoder_steps(batches):  # the parser runs max(label length) + 1 times per batch
        return sum(max(len(data[i].tokens) for i in b) + 1 for b in batches)

    by_size = make_batches(data, pixel_budget=20000, max_batch=6)
    by_tokens = make_batches(data, pixel_budget=20000, max_batch=6, bucket_by="tokens")
    assert sorted(i for b in by_tokens for i in b) == list(range(len(data)))
    for b in by_tokens:
        h = max(data[i].image.shape[0] for i in b)
        w = max(data[i].image.shape[1] for i in b)
        assert len(b) <= 6 and (len(b) == 1 or h * w * len(b) <= 20000)
    lengths = [len(data[b[0]].tokens) for b in by_tokens]
    assert lengths == sorted(lengths)
    assert decoder_steps(by_tokens) < 0.8 * decoder_steps(by_size)
    with pytest.raises(ValueError, match="data.batch.bucket_by"):
        make_batches(data, 20000, 6, bucket_by="width")


def test_collate_pads_with_masks():
    data = samples(3)
    vocab = Vocab.build(s.tokens for s in data)
    batch = collate(data, vocab)
    b, _, h, w = batch.images.shape
    assert b == 3 and h == max(s.image.shape[0] for s in data) and w == max(s.image.shape[1] for s in data)
    for k, s in enumerate(data):
        sh, sw = s.image.shape
        assert batch.image_mask[k].sum() == sh * sw and batch.image_mask[k, :sh, :sw].all()
        assert batch.images[k, 0, sh:, :].abs().sum() == 0 and batch.images[k, 0, :, sw:].abs().sum() == 0
        n = len(s.tokens)
        assert batch.target_mask[k].sum() == n + 1  # tokens + <eol>
        assert batch.targets[k, n] == 0
        assert vocab.decode(batch.targets[k].tolist()) == s.tokens


def test_stream_is_deterministic_and_resumable():
    data = samples()
    vocab = Vocab.build(s.tokens for s in data)

    def stream():
        return BatchStream(data, vocab, pixel_budget=6000, max_batch=4, seed=3)

    a = stream()
    ids = [a.next().ids for _ in range(len(a) * 2 + 3)]
    first_epoch = ids[: len(a)]
    assert sorted(i for b in first_epoch for i in b) == sorted(s.id for s in data)  # one epoch sees all
    assert ids[: len(a)] != ids[len(a) : 2 * len(a)]  # a new order each epoch
    b = stream()
    for _ in range(5):
        b.next()
    state = b.state_dict()
    c = stream()
    c.load_state_dict(state)
    assert [c.next().ids for _ in range(len(a))] == ids[5 : 5 + len(a)]


def test_ranks_get_disjoint_batches():
    data = samples()
    vocab = Vocab.build(s.tokens for s in data)
    r0 = BatchStream(data, vocab, 6000, 4, seed=1, rank=0, world_size=2)
    r1 = BatchStream(data, vocab, 6000, 4, seed=1, rank=1, world_size=2)
    assert len(r0) == len(r1)
    ids0 = {i for _ in range(len(r0)) for i in r0.next().ids}
    ids1 = {i for _ in range(len(r1)) for i in r1.next().ids}
    assert not ids0 & ids1


def test_curriculum_epochs_go_from_short_labels_to_long():
    data = samples(60)
    vocab = Vocab.build(s.tokens for s in data)
    stream = BatchStream(data, vocab, 6000, 4, seed=0, curriculum_epochs=1)
    longest = [max(len(data[i].tokens) for i in b) for b in stream.batches]
    first = [longest[b] for b in stream.epoch_order(0)]
    assert first == sorted(first) and first[0] < first[-1]
    assert sorted(stream.epoch_order(1)) == list(range(len(stream.batches)))
    assert stream.epoch_order(1) != stream.epoch_order(0)  # shuffled again after the curriculum
    plain = BatchStream(data, vocab, 6000, 4, seed=0)
    assert plain.epoch_order(0) != stream.epoch_order(0)
