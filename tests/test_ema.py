"""trainer.ema_decay: an exponential moving average of the weights is the model every reading takes (validation,
best.pt, the test, evaluate.py, predict.py, init_from), updated after each applied step only, saved and resumed
with the run; the training weights stay the ones training, resume and replay start from."""

import json
import os
import sys

import pytest
import torch
from conftest import ROOT, compose_config, python_run, refusal_in_process, run_train

from wapstable.checkpoint import inference_weights, load_checkpoint, save_checkpoint
from wapstable.data.vocab import Vocab
from wapstable.eval.evaluation import load_model
from wapstable.model.wap import build_model
from wapstable.train.build import init_from
from wapstable.train.ema import WeightAverage, warmed_decay


def test_the_average_follows_its_formula_and_starts_from_the_weights():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = WeightAverage(model, decay=0.75)
    assert ema.updates == 0 and torch.equal(ema.module.weight, model.weight)
    ema.update(model)  # the first update copies
    with torch.no_grad():
        model.weight.fill_(12.0)
    ema.update(model)  # after 1 update the warm-up's decay, 2 / 11: 2 / 11 * 1 + 9 / 11 * 12 = 10
    assert ema.updates == 2
    assert torch.allclose(ema.module.weight, torch.full((1, 2), 10.0))
    ema.averaged.n_averaged.fill_(100)  # after 100 updates, (1 + 100) / 110 > 0.75: the decay itself
    with torch.no_grad():
        model.weight.fill_(14.0)
    ema.update(model)  # 0.75 * 10 + 0.25 * 14
    assert torch.allclose(ema.module.weight, torch.full((1, 2), 11.0))
    assert not ema.module.weight.requires_grad
    assert warmed_decay(0.999, 0) == 0.1 and warmed_decay(0.999, 10**6) == 0.999
    restored = WeightAverage(torch.nn.Linear(2, 1), decay=0.75)
    restored.load_state_dict(ema.state_dict())
    assert restored.updates == 101 and torch.equal(restored.module.weight, ema.module.weight)


def test_a_run_reads_its_average_and_a_skipped_step_leaves_it(tmp_path, cache_dir):
    run = tmp_path / "run"
    # 6 steps, step 2's loss made infinite (skipped), evaluations at 3 and 6
    run_train(
        [
            "trainer.ema_decay=0.5",
            "trainer.max_steps=6",
            "fault=inf_loss",
            "fault.step=2",
        ],
        run,
        cache_dir,
    )
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    assert last["counters"]["accepted"] == 5
    assert last["ema"]["updates"] == 5 and last["ema"]["decay"] == 0.5  # not the skipped step
    weights, average = last["model"], last["ema"]["weights"]
    assert weights.keys() == average.keys()
    assert any(not torch.equal(weights[k], average[k]) for k in weights if weights[k].is_floating_point())
    # what evaluate.py and predict.py load is the average
    model, _, _ = load_model(run / "checkpoints" / "last.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(value, average[key]), key
    # and the trainer's test read best.pt's average: evaluate.py's WER on it is the run's own
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    assert best["ema"]["updates"] == {3: 2, 6: 5}[best["step"]]
    metrics = json.loads((run / "metrics.json").read_text())
    out = tmp_path / "eval.json"
    proc = python_run(
        [
            sys.executable,
            str(ROOT / "scripts" / "evaluate.py"),
            str(run / "checkpoints" / "best.pt"),
            "split=test",
            "data.normalize=false",  # the pixels the run read
            "--out",
            str(out),
        ],
        env={**os.environ, "WAPSTABLE_CACHE": str(cache_dir)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["wer"] == pytest.approx(metrics["test_wer"])


def test_an_average_off_is_none_and_reads_the_weights(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train([], run, cache_dir)
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    assert last["ema"] is None
    assert inference_weights(last) is last["model"]


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1"])
def test_a_decay_outside_0_1_is_refused(tmp_path, cache_dir, value):
    message = refusal_in_process([f"trainer.ema_decay={value}"], tmp_path / "run", cache_dir)
    assert f"trainer.ema_decay={float(value)}" in message and "[0, 1)" in message


def test_init_from_takes_the_average(tmp_path):
    vocab = Vocab(["<eol>", "x", "+"])
    cfg = compose_config(["debug=tiny"]).model
    torch.manual_seed(0)
    trained, averaged, fresh = (build_model(cfg, len(vocab)) for _ in range(3))
    save_checkpoint(
        {
            "model": trained.state_dict(),
            "ema": {"decay": 0.9, "updates": 7, "weights": averaged.state_dict()},
            "vocab": vocab.tokens,
        },
        tmp_path / "src.pt",
    )
    init_from(fresh, tmp_path / "src.pt", vocab)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, averaged.state_dict()[key]), key


def test_a_resume_that_turns_the_average_on_starts_it_from_the_weights(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train([], run, cache_dir)  # 3 steps without an average
    run_train(["resume=auto", "trainer.max_steps=6", "trainer.ema_decay=0.5"], run, cache_dir)
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    assert last["step"] == 6 and last["config"]["trainer"]["ema_decay"] == 0.5
    assert last["ema"]["updates"] == 3  # the resumed steps only: the average starts at the resumed weights
