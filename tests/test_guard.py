"""The non-finite guard: a skipped step leaves weights, optimizer state, schedule and history bit-identical."""

import copy
import json

import pytest
import torch
from conftest import TINY, assert_identical, compose_config, run_train

from wapstable.stability.guard import SkipBudget, SpikeDetector
from wapstable.train.loop import Trainer


def make_trainer(tmp_path, cache_dir, *overrides):
    cfg = compose_config([*TINY, *overrides], run_dir=tmp_path / "run")
    cfg.data.cache_dir = str(cache_dir)
    return Trainer(cfg)


def snapshot(trainer):
    return copy.deepcopy(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "history": trainer.history.state_dict(),
            "lr": [g["lr"] for g in trainer.optimizer.param_groups],
        }
    )


@pytest.mark.parametrize("optim", ["adadelta", "adam", "sgd"])
@pytest.mark.parametrize("fault", ["nan_input", "inf_loss"])
def test_skipped_step_changes_nothing(tmp_path, cache_dir, optim, fault):
    trainer = make_trainer(
        tmp_path,
        cache_dir,
        f"optim={optim}",
        f"fault={fault}",
        "fault.step=2",
        "clip=autoclip",
        "optim.schedule=cosine",
    )
    for _ in range(2):  # two good steps, so the optimizer has moments and step counters
        out = trainer.train_step(trainer.stream.next())
        assert not out.skipped
        trainer.step += 1
    before = snapshot(trainer)
    out = trainer.train_step(trainer.stream.next())
    assert out.skipped and "non-finite" in out.reason
    assert ("loss" in out.reason) == (fault in ("nan_input", "inf_loss"))
    assert_identical(before, snapshot(trainer))
    assert all(p.grad is None for p in trainer.model.parameters())  # gradients zeroed
    assert trainer.budget.total == 1 and out.anomaly_path is not None and out.anomaly_path.is_file()
    trainer.handle_skip(out)  # warns and localises; the budget is not spent


def test_fault_run_skips_exactly_once(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = run_train(
        [
            "fault=nan_input",
            "fault.step=5",
            "trainer.max_steps=10",
            "trainer.eval_every=10",
            "trainer.checkpoint_every=10",
        ],
        run,
        cache_dir,
    )
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["skipped_steps"] == 1 and metrics["anomaly_checkpoints"] == 1
    assert [p.name for p in (run / "anomalies").iterdir()] == ["step-5.pt"]
    assert "step 5 skipped: non-finite loss" in proc.stdout + proc.stderr
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_unguarded_run_is_poisoned(tmp_path, cache_dir):
    """Without the guard the same fault turns the weights NaN: the guard is what saves the run."""
    run = tmp_path / "run"
    run_train(["fault=nan_input", "fault.step=1", "guard.skip_nonfinite=false"], run, cache_dir, check=False)
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert not all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_consecutive_budget_stops_with_checkpoint(tmp_path, cache_dir):
    run = tmp_path / "run"
    args = [
        "fault=inf_loss",
        "fault.step=1",
        "fault.steps=100",
        "trainer.max_steps=20",
        "guard.max_consecutive_skips=3",
    ]
    proc = run_train(args, run, cache_dir, check=False)
    assert proc.returncode == 3
    assert "4 consecutive skipped steps exceed guard.max_consecutive_skips=3" in proc.stdout + proc.stderr
    assert sorted(p.name for p in (run / "anomalies").iterdir()) == ["step-1.pt", "step-2.pt", "step-3.pt"]
    assert (run / "checkpoints" / "last.pt").is_file()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_runs_and_guards(tmp_path, cache_dir, precision):
    run = tmp_path / "run"
    run_train([f"trainer.precision={precision}", "fault=nan_input", "fault.step=1"], run, cache_dir)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["skipped_nonfinite"] == 1


def test_spike_detector_and_budget():
    spikes = SpikeDetector(window=16, zscore=4.0, warmup=8)
    for i in range(16):
        assert spikes.check(10.0 + 0.1 * (i % 3), 1.0 + 0.01 * (i % 2)) is None or i < 8
        spikes.update(10.0 + 0.1 * (i % 3), 1.0 + 0.01 * (i % 2))
    assert "loss spike" in spikes.check(100.0, 1.0)
    assert "grad-norm spike" in spikes.check(10.0, 50.0)
    budget = SkipBudget(max_consecutive=2, max_total=3)
    for skipped in [True, True, False, True]:
        budget.record(skipped)
        assert budget.exhausted() is None
    budget.record(True)
    assert "max_total_skips=3" in budget.exhausted()


def test_skip_spikes_through_train(tmp_path, cache_dir):
    run = tmp_path / "run"
    args = [
        "guard.skip_spikes=true",
        "guard.spike_warmup=3",
        "guard.spike_zscore=3",
        "fault=lr_spike",
        "fault.step=4",
        "fault.scale=1e3",
        "trainer.max_steps=8",
        "guard.max_consecutive_skips=10",
    ]
    proc = run_train(args, run, cache_dir)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["skipped_spikes"] >= 1 and metrics["skipped_nonfinite"] == 0
    assert "step 5 skipped: loss spike" in proc.stdout + proc.stderr


def test_detect_anomaly_mode_runs(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train(["guard.detect_anomaly=true"], run, cache_dir)
    assert json.loads((run / "metrics.json").read_text())["steps"] == 3
