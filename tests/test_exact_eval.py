"""The evaluation path end to end on hand-made predictions that score above zero, every figure computed by hand.

A scripted network stands in for a trained one: it recognises each image by its pixels and puts all probability
on the tokens this file chose for that image. Everything else is the real code the scripts run: checkpoint
loading and config composition, the data readers (WAP pickles, CROHME InkML with its unreadable file), WAP-style
batching (sorted by size, so batches do not follow the data's order), greedy and beam-search decoding, the
vocabulary, ExpressionMetrics, score_test_sets / combine_sets, `wapstable-evaluate`'s printed table and JSON, and
the trainer's metrics.json. Predictions and references have different lengths, so WER (edits over *reference*
tokens) changes when the two are swapped: 39.29 % here, 44.00 % swapped.
"""

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, compose_config
from omegaconf import OmegaConf

from wapstable.checkpoint import save_checkpoint
from wapstable.data.batches import load_splits
from wapstable.data.latex import crohme_vocab
from wapstable.data.sample import Sample
from wapstable.data.sources.wap_pkl import write_wap_split
from wapstable.data.vocab import Vocab
from wapstable.eval import evaluation
from wapstable.eval.evaluation import combine_sets, evaluate_samples, score_test_sets
from wapstable.model.wap import build_model

# ---------------------------------------------------------------------------------------------------------------
# the hand-made data: (id, CROHME truth, reference tokens, predicted tokens); edits and lengths in the comments

SET_2014 = [
    ("r0", "$a+b$", "a + b", "a + b"),  # 0 edits; reference 3 tokens, prediction 3
    ("r1", "$x^{2}$", "x ^ { 2 }", "x ^ { 3 }"),  # 1 (a substitution); 5, 5
    ("r2", "$abcdef$", "a b c d e f", "a b c d"),  # 2 (deletions); 6, 4
    ("r3", "$12$", "1 2", "1 2 3 4 5"),  # 3 (insertions); 2, 5
    ("r4", "$xyzw$", "x y z w", "a"),  # 4 (one substitution, three deletions); 4, 1
]
SET_2016 = [
    ("s0", r"$\frac{1}{2}$", r"\frac { 1 } { 2 }", r"\frac { 1 } { 2 }"),  # 0; 7, 7
    ("s1", "$y$", "y", ""),  # 1 (the empty prediction: <eol> first); 1, 0
]
CASES = SET_2014 + SET_2016
REFS = {i: ref.split() for i, _, ref, _ in CASES}
PREDS = {i: pred.split() for i, _, _, pred in CASES}
# Each image's width, in an order unlike the ids', so the size-sorted batches mix the samples up.
ORDER = {"r0": 5, "r1": 1, "r2": 3, "r3": 0, "r4": 4, "s0": 6, "s1": 2}

# All seven as one set. 2 exact (r0, s0); <=1 edit: 4 (+ r1, s1); <=2: 5 (+ r2); <=3: 6 (+ r3).
# Edits 0+1+2+3+4+0+1 = 11 over reference tokens 3+5+6+2+4+7+1 = 28; over the predictions' 3+5+4+5+1+7+0 = 25
# tokens (prediction and reference swapped) it would be 44.00 %.
ALL = {
    "count": 7,
    "exprate": 100 * 2 / 7,  # 28.57
    "within_1": 100 * 4 / 7,  # 57.14
    "within_2": 100 * 5 / 7,  # 71.43
    "within_3": 100 * 6 / 7,  # 85.71
    "wer": 100 * 11 / 28,  # 39.29
    "ref_tokens": 28,
    # references of 1-5 tokens: r0 r1 r3 r4 s1, one exact (r0); of 6-10: r2 s0, one exact (s0)
    "by_length": {"1-5": {"count": 5, "exprate": 20.0}, "6-10": {"count": 2, "exprate": 50.0}},
}
SWAPPED_WER = 100 * 11 / 25

# The two CROHME test sets. 2014 holds one more file that cannot be read: it counts as wrong, so its figures are over
# 6 files; WER is over the 5 read ones (10 edits, 20 reference tokens). 2016: 1 edit over 8 tokens.
SETS = {
    "2014": {
        "total": 6,
        "read": 5,
        "exprate": 100 * 1 / 6,  # 16.67
        "exprate_read": 100 * 1 / 5,  # 20.00
        "within_1": 100 * 2 / 6,  # 33.33
        "within_2": 100 * 3 / 6,  # 50.00
        "within_3": 100 * 4 / 6,  # 66.67
        "wer": 100 * 10 / 20,  # 50.00 (swapped: 10 / 18 = 55.56)
    },
    "2016": {
        "total": 2,
        "read": 2,
        "exprate": 50.0,
        "exprate_read": 50.0,
        "within_1": 100.0,
        "within_2": 100.0,
        "within_3": 100.0,
        "wer": 100 * 1 / 8,  # 12.50 (swapped: 1 / 7 = 14.29)
    },
}
# Both sets together: 8 files, 2 exact, 4 / 5 / 6 within 1 / 2 / 3 edits; WER 11 edits over 28 tokens.
BOTH = {
    "total": 8,
    "read": 7,
    "exprate": 25.0,
    "within_1": 50.0,
    "within_2": 62.5,
    "within_3": 75.0,
    "wer": 100 * 11 / 28,
}
# The rows the CROHME table prints, as a reader would copy them from the papers' tables.
SET_ROWS = {
    "2014": ["2014", "6", "5", "16.67", "33.33", "50.00", "66.67", "50.00"],
    "2016": ["2016", "2", "2", "50.00", "100.00", "100.00", "100.00", "12.50"],
}
# format_table's rows for all seven as one set.
PLAIN_ROWS = [
    ["count", "7"],
    ["exprate", "28.57"],
    ["within_1", "57.14"],
    ["within_2", "71.43"],
    ["within_3", "85.71"],
    ["wer", "39.29"],
    ["1-5", "5", "20.00"],
    ["6-10", "2", "50.00"],
]


def approx(expected: dict) -> dict:
    return {k: pytest.approx(v, abs=1e-9) if isinstance(v, float) else v for k, v in expected.items()}


def pick(result: dict, keys) -> dict:
    return {k: result[k] for k in keys}


# ---------------------------------------------------------------------------------------------------------------
# the scripted network


def image_key(pixels: np.ndarray) -> bytes:
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    return np.asarray(pixels.shape, np.int64).tobytes() + pixels.tobytes()


class Script:
    """The hand-made prediction of each image, found by the image's pixels (a batch's padding cropped off)."""

    def __init__(self, samples, vocab: Vocab):
        self.by_image: dict[bytes, list[int]] = {}
        for s in samples:
            pred = vocab.encode(PREDS[s.id.rsplit("/", 1)[-1]])
            key = image_key(s.image)
            # two samples of one image must be meant to read the same, or the script could not tell them apart
            assert self.by_image.setdefault(key, pred) == pred, f"{s.id}: another sample has the same image"

    def __call__(self, images: torch.Tensor, image_mask: torch.Tensor) -> list[list[int]]:
        out = []
        for b in range(images.size(0)):
            valid = image_mask[b] > 0
            h, w = int(valid.any(1).sum()), int(valid.any(0).sum())
            pixels = (images[b, 0, :h, :w] * 255).round().to(torch.uint8).cpu().numpy()
            key = image_key(pixels)
            assert key in self.by_image, f"an image of {h}x{w} pixels that the test did not script"
            out.append(self.by_image[key])
        return out


@dataclass
class ScriptState:
    target: torch.Tensor  # (B, T) the scripted tokens, then <eol> = 0
    t: torch.Tensor  # (B,) tokens read so far
    coverage: torch.Tensor  # (B, 1, 1): the decoders read the feature grid's shape from it


class ScriptedModel(torch.nn.Module):
    """The decoder interface of WAP (encode, init_state, step, select_state): at step t every row puts all but
    e^-30 of its probability on token t of its image's script, then on <eol>."""

    def __init__(self, script: Script, vocab_size: int):
        super().__init__()
        self.script, self.vocab_size, self.start_index = script, vocab_size, vocab_size

    def encode(self, images, image_mask):
        seqs = self.script(images, image_mask)
        target = torch.zeros(len(seqs), max(map(len, seqs)) + 1, dtype=torch.long, device=images.device)
        for i, s in enumerate(seqs):
            target[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return target, image_mask.new_ones(len(seqs), 1, 1)

    def init_state(self, target, feat_mask):
        t = torch.zeros(target.size(0), dtype=torch.long, device=target.device)
        return ScriptState(target, t, feat_mask.new_zeros(feat_mask.shape))

    @staticmethod
    def select_state(state, index, memory=True):
        return ScriptState(*(x.index_select(0, index) for x in (state.target, state.t, state.coverage)))

    def step(self, state, prev_tokens):
        B = prev_tokens.size(0)
        t = state.t.clamp(max=state.target.size(1) - 1)  # past the script: its last column, <eol>
        want = state.target.gather(1, t[:, None]).squeeze(1)
        logits = torch.full((B, self.vocab_size), -30.0, device=prev_tokens.device)
        logits[torch.arange(B, device=logits.device), want] = 0.0
        alpha = state.coverage.new_ones(B, 1, 1)
        return (
            F.log_softmax(logits, -1),
            ScriptState(state.target, state.t + 1, state.coverage + alpha),
            alpha,
        )


@pytest.fixture
def scripted_decode(monkeypatch):
    """Make every evaluation decode with the scripted network in place of the model it was given (the real
    greedy or beam search all the same); returns the list of beam sizes the evaluations asked for."""
    real = evaluation.decode
    beams = []

    def install(samples, vocab):
        model = ScriptedModel(Script(samples, vocab), len(vocab))

        def decode(_model, images, image_mask, beam_size, max_len, **options):
            beams.append(beam_size)
            return real(model, images, image_mask, beam_size, max_len, **options)

        monkeypatch.setattr(evaluation, "decode", decode)
        return beams

    return install


# ---------------------------------------------------------------------------------------------------------------
# data on disk


def image(k: int) -> np.ndarray:
    """A 12 x (8 + 3k) image, ink bright on 0, different for each k."""
    img = np.zeros((12, 8 + 3 * k), np.uint8)
    img[2 + k % 8, :] = 255
    img[:, k] = 200
    return img


def wap_samples() -> list[Sample]:
    return [Sample(i, image(ORDER[i]), REFS[i]) for i, *_ in CASES]


def write_wap(root):
    """A WAP-pickle data set whose test split is the seven cases; every split the same."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        write_wap_split(wap_samples(), root / f"offline-{split}.pkl", root / f"{split}_caption.txt")
    vocab = Vocab.build([*REFS.values(), *PREDS.values()])
    vocab.save(root / "dictionary.txt")
    return vocab


INKML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<ink xmlns="http://www.w3.org/2003/InkML">'
    '<annotation type="truth">{truth}</annotation>'
    '<trace id="0">0 0, 10 10</trace><trace id="1">0 10, 10 0</trace><trace id="2">12 5, {end} 5</trace></ink>'
)


def write_crohme(root):
    """CROHME_labeled_2016 in small: the two test sets (2014 with one malformed file), a validation folder with
    the 2016 files, training files; each file's ink a cross and a stroke of its own length."""

    def write(folder, cases):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i, truth, _, _ in cases:
            text = INKML.format(truth=truth, end=16 + 5 * ORDER[i])
            (root / folder / f"{i}.inkml").write_text(text, encoding="utf-8")

    write("TestEM2014GT", SET_2014)
    (root / "TestEM2014GT" / "broken.inkml").write_text("<ink><trace>1 2, 3 4</trace>", encoding="utf-8")
    write("TEST2016_INKML_GT", SET_2016)
    write("valid", SET_2016)
    write("TrainINKML", CASES)
    return root


def crohme_overrides(root, cache):
    return [
        "data=crohme",
        f"data.root={root}",
        "data.valid=valid",
        f"data.cache_dir={cache}",
        "data.height=32",
    ]


def write_checkpoint(path, cfg, vocab: Vocab):
    """A checkpoint as training writes one (an untrained model: the scripted network reads in its place)."""
    model = build_model(cfg.model, len(vocab))
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    save_checkpoint({"model": model.state_dict(), "vocab": list(vocab.tokens), "config": config}, path)
    return path


def table_rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split()]


# ---------------------------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize(("beam_size", "max_batch"), [(1, 3), (4, 3), (1, 1), (10, 8)])
def test_evaluate_samples_scores_hand_made_predictions(beam_size, max_batch):
    """evaluate_samples, which training, evaluate.py and metrics.json all use: the exact figures, greedy and beam,
    one image per batch and several in size order."""
    samples = wap_samples()
    vocab = Vocab.build([*REFS.values(), *PREDS.values()])
    model = ScriptedModel(Script(samples, vocab), len(vocab))
    r = evaluate_samples(model, vocab, samples, beam_size, 12, 10_000, max_batch, "cpu")
    assert pick(r, ALL) == approx(ALL)
    assert r["wer"] != pytest.approx(SWAPPED_WER)  # the figure that tells prediction and reference apart


def test_score_test_sets_on_hand_made_predictions():
    """score_test_sets over evaluate_samples: each set over all of its files (the unreadable one is wrong)."""
    samples = [s._replace(id=f"{'2014' if s.id[0] == 'r' else '2016'}/{s.id}") for s in wap_samples()]
    vocab = Vocab.build([*REFS.values(), *PREDS.values()])
    model = ScriptedModel(Script(samples, vocab), len(vocab))

    def evaluate(group):
        return evaluate_samples(model, vocab, group, 3, 12, 10_000, 2, "cpu")

    sets = score_test_sets(evaluate, samples, {"2014": 6, "2016": 2})
    assert list(sets) == ["2014", "2016"]
    for name, expected in SETS.items():
        assert pick(sets[name], expected) == approx(expected), name
    assert combine_sets(sets) == approx(BOTH)


def test_evaluate_command_prints_and_writes_the_hand_made_figures(tmp_path, scripted_decode, capsys):
    """`wapstable-evaluate CKPT` on WAP pickles: the printed table and eval-test.json, with the checkpoint's
    final beam (10) and with greedy decoding, three images per batch."""
    from wapstable.cli import evaluate as cli

    root = tmp_path / "wap"
    vocab = write_wap(root)
    cfg = compose_config([*TINY, "data=wap_pkl", f"data.root={root}"], run_dir=tmp_path / "run")
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt", cfg, vocab)
    beams = scripted_decode(load_splits(cfg.data, which=("test",))["test"], vocab)

    for args, beam in (([], 10), (["decode.beam_size=1"], 1)):
        out = tmp_path / f"beam{beam}.json"
        assert cli.main([str(ckpt), "data.batch.max_batch=3", *args, "--out", str(out)]) == 0
        rows = table_rows(capsys.readouterr().out)
        assert [row for row in rows if row[0] in {r[0] for r in PLAIN_ROWS}] == PLAIN_ROWS
        result = json.loads(out.read_text())
        assert pick(result, ALL) == approx(ALL)
        assert result["split"] == "test" and result["beam_size"] == beam
        assert set(beams) == {beam} and len(beams) == 3  # seven images, three per batch
        beams.clear()


def test_evaluate_command_on_crohme_test_sets(tmp_path, scripted_decode, capsys):
    """`wapstable-evaluate CKPT split=test` on CROHME InkML: one row per test set, as the papers' tables, and the
    same figures with the sets together in the JSON."""
    from wapstable.cli import evaluate as cli

    root = write_crohme(tmp_path / "CROHME_labeled_2016")
    cfg = compose_config([*TINY, *crohme_overrides(root, tmp_path / "cache")], run_dir=tmp_path / "run")
    vocab = crohme_vocab()
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt", cfg, vocab)
    test = load_splits(cfg.data, which=("test",))["test"]
    assert {s.id: s.tokens for s in test} == {
        f"{'2014' if i[0] == 'r' else '2016'}/{i}": REFS[i] for i in REFS
    }
    beams = scripted_decode(test, vocab)

    out = tmp_path / "eval.json"
    assert cli.main([str(ckpt), "split=test", "data.batch.max_batch=2", "--out", str(out)]) == 0
    rows = {row[0]: row for row in table_rows(capsys.readouterr().out)}
    assert rows["2014"] == SET_ROWS["2014"] and rows["2016"] == SET_ROWS["2016"]
    assert rows["test"] == ["test", "set", "total", "read", "ExpRate", "<=1", "<=2", "<=3", "WER"]
    result = json.loads(out.read_text())
    assert pick(result, BOTH) == approx(BOTH)
    for name, expected in SETS.items():
        assert pick(result["sets"][name], expected) == approx(expected), name
    assert result["beam_size"] == 10 and set(beams) == {10}


def test_training_writes_the_hand_made_figures_to_metrics_json(tmp_path, scripted_decode):
    """A real (tiny, 3-step) training run on the CROHME files: its validation record and the final test
    evaluation of metrics.json, whose test_exprate is over both test sets' files."""
    from wapstable.train.stages import train

    root = write_crohme(tmp_path / "CROHME_labeled_2016")
    overrides = [*TINY, *crohme_overrides(root, tmp_path / "cache"), "logger=csv"]
    cfg = compose_config(overrides, run_dir=tmp_path / "run")
    splits = load_splits(cfg.data, which=("valid", "test"))
    beams = scripted_decode([*splits["valid"], *splits["test"]], crohme_vocab())

    train(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3
    # the validation split is the 2016 files: 1 of 2 exact, 1 edit over 8 tokens (greedy, decode.beam_size)
    assert metrics["final_valid_exprate"] == pytest.approx(50.0)
    assert metrics["final_valid_wer"] == pytest.approx(12.5)
    assert metrics["best_valid_exprate"] == pytest.approx(50.0)
    # the test evaluation, with decode.final_beam_size
    assert metrics["test_exprate"] == pytest.approx(BOTH["exprate"])
    assert metrics["test_within_1"] == pytest.approx(BOTH["within_1"])
    assert metrics["test_wer"] == pytest.approx(BOTH["wer"])
    keys = ("total", "read", "exprate", "within_1", "within_2", "within_3", "wer")
    assert metrics["test_sets"] == {name: approx(pick(SETS[name], keys)) for name in SETS}
    assert beams == [1, 10, 10]  # one validation (1 batch), then one batch per test set
