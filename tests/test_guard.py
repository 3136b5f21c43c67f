"""The non-finite guard: a skipped step leaves weights, optimizer state, schedule and history bit-identical."""

import copy
import json
import math
import re

import pytest
import torch
from conftest import SPIKE_AT_STEP_5, TINY, assert_identical, build_trainer, run_train

from wapstable.stability.guard import SkipBudget, SpikeDetector
from wapstable.stability.step_guard import Outcome


def make_trainer(tmp_path, cache_dir, *overrides):
    return build_trainer([*TINY, *overrides], tmp_path / "run", cache_dir)


def snapshot(trainer):
    return copy.deepcopy(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "clip": trainer.clip.state_dict(),
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
        trainer.go_to_step(trainer.step + 1)
    before = snapshot(trainer)
    out = trainer.train_step(trainer.stream.next())
    # both faults reach the loss (a NaN pixel spreads through the convolutions; inf_loss multiplies it): the reason
    # names the loss, not the gradients, and counts the gradient tensors the non-finite loss spoiled
    assert out.skipped and not math.isfinite(out.loss)
    reason = re.fullmatch(r"non-finite loss \((\d+) gradient tensors non-finite\)", out.reason)
    assert reason is not None and int(reason[1]) > 0, out.reason
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


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
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
        *SPIKE_AT_STEP_5,
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


class InfInBackward(torch.autograd.Function):
    """Identity in forward; in backward one value of the incoming gradient becomes +Inf (an op whose backward
    overflows while its forward, and so the loss, stay finite)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        grad.view(-1)[0] = float("inf")
        return grad


def counted(trainer):
    """The step counters a skip must leave alone (optimizer and scheduler ones are in their state_dicts)."""
    c = trainer.guard.counters()
    return {k: c[k] for k in ("accepted", "clipped", "scaler_skips")}


def take(trainer, n):
    """n accepted steps through the trainer's own step code."""
    for _ in range(n):
        out = trainer.train_step(trainer.stream.next())
        assert not out.skipped, out.reason
        trainer.go_to_step(trainer.step + 1)


@pytest.mark.parametrize("optim", ["adadelta", "adam", "sgd"])
def test_a_nonfinite_gradient_with_a_finite_loss_changes_nothing(tmp_path, cache_dir, optim):
    """The guard's gradient branch in the trainer: the loss is finite, the watcher's gradients are not. Weights,
    BatchNorm statistics, moments, step counters, schedule and AutoClip history stay bit-identical."""
    trainer = make_trainer(tmp_path, cache_dir, f"optim={optim}", "clip=autoclip", "optim.schedule=cosine")
    take(trainer, 2)
    before, counters = snapshot(trainer), counted(trainer)
    last_conv = trainer.model.watcher.blocks[-1][-1]  # conv + BatchNorm, the watcher's last layer
    handle = last_conv.register_forward_hook(lambda module, args, out: InfInBackward.apply(out))
    try:
        out = trainer.train_step(trainer.stream.next())
    finally:
        handle.remove()
    assert out.skipped and out.counted and math.isfinite(out.loss)
    assert out.reason.startswith("non-finite gradients (") and not math.isfinite(out.grad_norm)
    assert_identical(before, snapshot(trainer))
    assert counted(trainer) == counters and trainer.guard.steps == 3
    assert trainer.budget.total == trainer.budget.nonfinite == 1
    assert all(p.grad is None for p in trainer.model.parameters())
    saved = torch.load(out.anomaly_path, weights_only=True)["state"]
    bad = saved["anomaly"]["nonfinite_counts"]
    assert bad and all(name.startswith("watcher.") for name in bad)  # the parser's gradients were finite
    trainer.go_to_step(trainer.step + 1)
    take(trainer, 1)  # and training goes on from the untouched weights


def test_a_spike_skip_changes_nothing(tmp_path, cache_dir):
    """guard.skip_spikes in the trainer: an lr spike at step 4 is accepted and does its damage, and the loss of
    step 5 is a spike. That step is skipped with weights, BatchNorm statistics, moments, step counters,
    schedule, AutoClip history and the spike window bit-identical."""
    trainer = make_trainer(
        tmp_path,
        cache_dir,
        *SPIKE_AT_STEP_5,
        "clip=autoclip",
        "trainer.max_steps=8",
    )
    take(trainer, 5)
    before = {**snapshot(trainer), "spikes": copy.deepcopy(trainer.spikes.state_dict())}
    counters = counted(trainer)
    assert len(before["spikes"]["losses"]) == 5
    out = trainer.train_step(trainer.stream.next())
    assert out.outcome is Outcome.SPIKE and out.reason.startswith("loss spike"), out
    assert math.isfinite(out.loss) and math.isfinite(out.grad_norm)
    assert_identical(before, {**snapshot(trainer), "spikes": trainer.spikes.state_dict()})
    assert counted(trainer) == counters and trainer.budget.spikes == 1 and trainer.budget.nonfinite == 0
    assert all(p.grad is None for p in trainer.model.parameters())


def test_an_fp16_scaler_skip_changes_nothing(tmp_path, cache_dir):
    """trainer.precision=fp16 on the CPU (autocast and a CPU GradScaler): with the scale grown too high the
    scaled gradients overflow float16 while the loss is finite. The scaler's skip leaves weights, BatchNorm
    statistics, moments, step counters, schedule and AutoClip history bit-identical, halves the scale, and is
    counted apart from the guard's budget."""
    trainer = make_trainer(
        tmp_path, cache_dir, "trainer.precision=fp16", "optim=adam", "clip=autoclip", "optim.schedule=cosine"
    )
    assert trainer.scaler.is_enabled() and trainer.guard.scaler is trainer.scaler
    accepted = 0
    for _ in range(8):  # until two steps are taken (the first scale may overflow, as fp16 runs start)
        accepted += not trainer.train_step(trainer.stream.next()).skipped
        trainer.go_to_step(trainer.step + 1)
        if accepted == 2:
            break
    assert accepted == 2
    trainer.scaler.update(new_scale=2.0**40)  # x 2^40 overflows float16's 65504 in backward
    before, counters = snapshot(trainer), counted(trainer)
    budget = trainer.budget.state_dict()
    out = trainer.train_step(trainer.stream.next())
    assert out.outcome is Outcome.SCALER and not out.counted and out.anomaly_path is None, out
    assert math.isfinite(out.loss) and out.reason.startswith("non-finite gradients")
    assert_identical(before, snapshot(trainer))
    assert counted(trainer) == {**counters, "scaler_skips": counters["scaler_skips"] + 1}
    assert trainer.budget.state_dict() == budget  # not against the budget
    assert trainer.scaler.get_scale() == 2.0**39
    assert all(p.grad is None for p in trainer.model.parameters())
