import gzip
import logging
import pickle

import numpy as np
import pytest

from wapstable.data.batches import check_labels
from wapstable.data.latex import DataError
from wapstable.data.sample import Sample
from wapstable.data.sources.wap_pkl import load_wap_split, write_wap_split
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError


def image(h, w, seed):
    img = np.zeros((h, w), np.uint8)
    img[h // 4 : h // 2, seed % w] = 255
    return img


SAMPLES = [
    Sample("18_em_0", image(20, 30, 1), "x ^ { 2 }".split()),
    Sample("MfrDB2656", image(16, 12, 5), "\\frac { 2 } { 4 }".split()),
    Sample("200923-131-29", image(8, 50, 7), ["8"]),
]


def paths(tmp_path):
    return tmp_path / "offline-train.pkl", tmp_path / "train_caption.txt"


def test_round_trip(tmp_path):
    pkl, txt = paths(tmp_path)
    write_wap_split(SAMPLES, pkl, txt)
    # the on-disk format is WAP's: [1, H, W] uint8 arrays and key<TAB>tokens lines
    with open(pkl, "rb") as f:
        raw = pickle.load(f)
    assert raw["18_em_0"].shape == (1, 20, 30) and raw["18_em_0"].dtype == np.uint8
    assert txt.read_text().splitlines()[1] == "MfrDB2656\t\\frac { 2 } { 4 }"

    samples, errors = load_wap_split(pkl, txt, "fail")
    assert errors == []
    assert [s.id for s in samples] == [s.id for s in SAMPLES]  # caption-file order
    for got, want in zip(samples, SAMPLES):
        assert got.tokens == want.tokens
        assert got.image.shape == want.image.shape and got.image.dtype == np.uint8
        assert np.array_equal(got.image, want.image)


def write_raw(tmp_path, images, captions):
    pkl, txt = paths(tmp_path)
    with open(pkl, "wb") as f:
        pickle.dump(images, f)
    txt.write_text(captions)
    return pkl, txt


def test_channel_first_and_2d_and_other_dtypes(tmp_path):
    a = image(10, 10, 3)
    images = {
        "chw": a[None],  # WAP's [1, H, W]
        "hw": a,
        "c3": np.stack([a, np.zeros_like(a), np.zeros_like(a)]),  # channel 0 is taken
        "f64": a.astype(np.float64),
        "bool": a > 0,
    }
    captions = "".join(f"{k}\tx\n" for k in images)
    samples, errors = load_wap_split(*write_raw(tmp_path, images, captions), "fail")
    assert errors == [] and len(samples) == 5
    for s in samples:
        assert s.image.shape == (10, 10) and s.image.dtype == np.uint8, s.id
        assert np.array_equal(s.image, a), s.id


def test_gzipped_pickle_and_bytes_keys(tmp_path):
    pkl, txt = paths(tmp_path)
    with gzip.open(pkl, "wb") as f:
        pickle.dump({b"k1": image(5, 5, 1)[None]}, f)
    txt.write_text("k1\ta b\n")
    samples, _ = load_wap_split(pkl, txt, "fail")
    assert samples[0].id == "k1" and samples[0].tokens == ["a", "b"]


def test_mismatches_fail_and_skip(tmp_path, caplog):
    images = {
        "ok": image(6, 6, 1)[None],
        "nocap": image(6, 6, 2)[None],
        "blank": np.zeros((1, 6, 6), np.uint8),
        "empty": np.zeros((1, 0, 6), np.uint8),
        "badline": image(6, 6, 3)[None],
        "strange": np.full((6, 6), 300.0),
    }
    captions = "ok\tx + 1\n\nnoimage\ty\nblank\tz\nempty\tz\nbadline\nstrange\tq\n"
    pkl, txt = write_raw(tmp_path, images, captions)

    with pytest.raises(DataError, match="badline") as e:  # the caption file is read first
        load_wap_split(pkl, txt, "fail")
    assert "train_caption.txt" in str(e.value)

    with caplog.at_level(logging.WARNING):
        samples, errors = load_wap_split(pkl, txt, "skip")
    assert [s.id for s in samples] == ["ok"]
    assert samples[0].tokens == ["x", "+", "1"]
    assert len(errors) == 6 and len(caplog.records) >= 6
    expect = {
        "badline": "no tokens",
        "noimage": "caption but no image",
        "blank": "blank",
        "empty": "empty",
        "strange": "outside 0..255",
        "nocap": "image but no caption",
    }
    for key, why in expect.items():
        assert sum(f"'{key}'" in m and why in m for m in errors) == 1, (key, errors)


def test_first_problem_raises_with_fail(tmp_path):
    pkl, txt = write_raw(tmp_path, {"a": image(4, 4, 1)}, "a\tx\nb\ty\n")
    with pytest.raises(DataError, match="'b' has a caption but no image"):
        load_wap_split(pkl, txt, "fail")
    pkl, txt = write_raw(tmp_path, {"a": image(4, 4, 1), "c": image(4, 4, 1)}, "a\tx\n")
    with pytest.raises(DataError, match="'c' has an image but no caption"):
        load_wap_split(pkl, txt, "fail")
    pkl, txt = write_raw(tmp_path, {"a": image(4, 4, 1)}, "a\tx\na\ty\n")
    with pytest.raises(DataError, match="second caption"):
        load_wap_split(pkl, txt, "fail")


def test_corrupt_or_missing_files(tmp_path):
    pkl, txt = paths(tmp_path)
    write_wap_split(SAMPLES, pkl, txt)
    data = pkl.read_bytes()
    pkl.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(DataError, match="offline-train.pkl cannot be loaded"):
        load_wap_split(pkl, txt, "skip")
    pkl.write_bytes(b"not a pickle at all")
    with pytest.raises(DataError, match="offline-train.pkl cannot be loaded"):
        load_wap_split(pkl, txt, "skip")
    with open(pkl, "wb") as f:
        pickle.dump([1, 2, 3], f)
    with pytest.raises(DataError, match="not a dict"):
        load_wap_split(pkl, txt, "skip")
    with pytest.raises(DataError, match="missing.pkl does not exist"):
        load_wap_split(tmp_path / "missing.pkl", txt, "skip")
    write_wap_split(SAMPLES, pkl, txt)
    with pytest.raises(DataError, match="nocaps.txt does not exist"):
        load_wap_split(pkl, tmp_path / "nocaps.txt", "skip")
    with pytest.raises(ValueError, match="on_error"):
        load_wap_split(pkl, txt, "maybe")


def test_write_rejects_unwritable_samples(tmp_path):
    pkl, txt = paths(tmp_path)
    with pytest.raises(ValueError, match="at least one token"):
        write_wap_split([Sample("a", image(4, 4, 1), [])], pkl, txt)
    with pytest.raises(ValueError, match="whitespace"):
        write_wap_split([Sample("a b", image(4, 4, 1), ["x"])], pkl, txt)
    with pytest.raises(ValueError, match="repeated"):
        write_wap_split([Sample("a", image(4, 4, 1), ["x"])] * 2, pkl, txt)


def test_with_a_wap_dictionary(tmp_path, caplog):
    pkl, txt = paths(tmp_path)
    write_wap_split(SAMPLES, pkl, txt)
    (tmp_path / "dictionary.txt").write_text("x\t1\n^\t2\n{\t3\n}\t4\n2\t5\n<eol>\t0\n")
    vocab = Vocab.load(tmp_path / "dictionary.txt")
    samples, _ = load_wap_split(pkl, txt, "fail")
    kept = check_labels(samples, vocab, "skip")  # the trainer's check of every split against its vocabulary
    assert [s.id for s in kept] == ["18_em_0"]
    errors = [r.getMessage() for r in caplog.records]
    assert any("MfrDB2656" in m and "\\frac" in m for m in errors)
    assert any("200923-131-29" in m and "'8'" in m for m in errors)
    with pytest.raises(UserError, match="the label of sample .* data.on_error=skip"):
        check_labels(samples, vocab, "fail")


def test_data_error_is_a_user_error():
    assert issubclass(DataError, UserError) and issubclass(DataError, ValueError)
