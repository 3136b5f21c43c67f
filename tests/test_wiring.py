"""The options whose values must reach their code, end to end: decode.length_power and decode.scales through the
final test of a training run and through evaluate.py, init_from through train.py (the weights compared), and
pretrain.in_budget (the run stops at the reduced budget). A dropped argument anywhere on the way fails here."""

import json

import pytest
import torch
from conftest import TINY, build_trainer, run_train

from wapstable.checkpoint import load_checkpoint
from wapstable.eval import evaluation


def spy_decode(monkeypatch) -> list[tuple]:
    """Record every decoding the evaluation code runs: (image height, beam size, length_power)."""
    calls = []
    real = evaluation.decode

    def recording(model, images, image_mask, beam_size, max_len, **kw):
        calls.append((images.shape[-2], beam_size, kw.get("length_power", 1.0)))
        return real(model, images, image_mask, beam_size, max_len, **kw)

    monkeypatch.setattr(evaluation, "decode", recording)
    return calls


def heights(calls, beam: int) -> set[int]:
    return {h for h, b, _ in calls if b == beam}


def test_decode_options_reach_the_final_test_of_a_run(tmp_path, cache_dir, monkeypatch):
    calls = spy_decode(monkeypatch)
    over = ["decode.final_beam_size=2", "decode.length_power=0.5", "decode.scales=[1.0,0.5]", "logger=[]"]
    trainer = build_trainer([*TINY, *over], tmp_path / "run", cache_dir)
    trainer.fit()
    final = [c for c in calls if c[1] == 2]  # validation decodes greedily (decode.beam_size=1)
    assert final and {p for _, _, p in final} == {0.5}
    tall = max(heights(calls, 2))
    assert any(abs(h - tall / 2) <= 1 for h in heights(calls, 2))  # each test batch read at half size too
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_length_power"] == 0.5 and metrics["test_scales"] == [1.0, 0.5]


def test_decode_options_reach_evaluate_py(tmp_path, cache_dir, monkeypatch):
    from wapstable.cli import evaluate

    run_train([], tmp_path / "run", cache_dir)
    monkeypatch.setenv("WAPSTABLE_CACHE", str(cache_dir))
    calls = spy_decode(monkeypatch)
    threads = torch.get_num_threads()
    try:
        code = evaluate.main(
            [
                str(tmp_path / "run" / "checkpoints" / "last.pt"),
                "decode.beam_size=3",
                "decode.length_power=0.25",
                "decode.scales=[1.0,0.6]",
                "--out",
                str(tmp_path / "e.json"),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert calls and {p for _, b, p in calls if b == 3} == {0.25}
    tall = max(heights(calls, 3))
    assert any(abs(h - tall * 0.6) <= 1 for h in heights(calls, 3))
    out = json.loads((tmp_path / "e.json").read_text())
    assert out["length_power"] == 0.25 and out["scales"] == [1.0, 0.6]


def floats(state: dict) -> dict:
    return {k: v for k, v in state.items() if v.is_floating_point()}


@pytest.mark.slow  # make test-all
def test_init_from_starts_the_run_from_those_weights(tmp_path, cache_dir):
    """The first step of a run started with init_from= is skipped (a NaN input), so its anomaly checkpoint holds
    the weights the run started from: exactly the source run's; a run without init_from starts elsewhere."""
    source = tmp_path / "source"
    run_train(["trainer.max_steps=4"], source, cache_dir)
    src = floats(load_checkpoint(source / "checkpoints" / "last.pt")["model"])
    first_skipped = ["fault=nan_input", "fault.step=0", "trainer.max_steps=2"]
    run_train(
        [*first_skipped, f"init_from={source / 'checkpoints' / 'last.pt'}"], tmp_path / "started", cache_dir
    )
    started = floats(load_checkpoint(tmp_path / "started" / "anomalies" / "step-0.pt")["model"])
    assert started.keys() == src.keys()
    assert all(torch.equal(started[k], src[k]) for k in src)
    run_train(first_skipped, tmp_path / "fresh", cache_dir)
    fresh = floats(load_checkpoint(tmp_path / "fresh" / "anomalies" / "step-0.pt")["model"])
    assert not all(torch.equal(fresh[k], src[k]) for k in src)


@pytest.mark.slow  # make test-all; make test keeps the reduced budget, saved and resumed (test_init_from.py)
def test_pretrain_in_budget_ends_the_run_at_the_reduced_budget(tmp_path, cache_dir):
    """trainer.max_minutes=0.15 with a pretraining inside it: the clock that ends the run is what the pretraining
    left, as the log's stop line and the checkpoint say."""
    run = tmp_path / "run"
    args = [
        "pretrain.steps=2",
        "pretrain.eval_every=2",
        "pretrain.in_budget=true",
        "trainer.max_minutes=0.15",
        "trainer.max_steps=1000000",
        "trainer.eval_every=100000",
        "trainer.checkpoint_every=100000",
    ]
    run_train(args, run, cache_dir)
    spent = json.loads((run / "pretrain" / "metrics.json").read_text())["wall_time_s"] / 60
    left = round(0.15 - spent, 3)
    assert 0 < left < 0.15
    assert f"trainer.max_minutes={left:g} spent: training ends at step" in (run / "train.log").read_text()
    assert load_checkpoint(run / "checkpoints" / "last.pt")["config"]["trainer"]["max_minutes"] == left
