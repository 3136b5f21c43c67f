"""StepGuard on small models, without a Trainer: bit-exact skips in every clip mode, the same step as a plain
loop, one host sync per taken step, the budget, anomaly checkpoints, and the plain-loop example."""

import copy
import math
import os
import sys

import pytest
import torch
from conftest import ROOT, assert_identical, python_run
from torch import nn

from wapstable.checkpoint import load_checkpoint
from wapstable.errors import TrainingStopped
from wapstable.stability import Outcome, StepGuard
from wapstable.stability.clip import AutoClipHistory, clip_gradients_
from wapstable.stability.guard import SpikeDetector

MODES = {
    "none": {},
    "norm": {"max_norm": 0.5},
    "value": {"value": 0.01},
    "inf": {"max_norm": 0.05},
    "agc": {"factor": 0.01},
    "autoclip": {"percentile": 10.0},
}


def two_layer(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def batches(n=6, nan_at=None):
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][0][1, 2] = float("nan")
    return out


def everything(model, optimizer, scheduler):
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("optim", ["adam", "sgd"])
def test_a_nan_batch_is_skipped_bit_exactly(mode, optim, tmp_path):
    model = two_layer()
    opt = (
        torch.optim.Adam(model.parameters(), 1e-2)
        if optim == "adam"
        else torch.optim.SGD(model.parameters(), 0.1)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    guard = StepGuard(model, opt, scheduler=sched, clip=mode, **MODES[mode], anomaly_dir=tmp_path)
    history_before = None
    for i, (x, y) in enumerate(batches(nan_at=3)):
        model.train()
        before = everything(model, opt, sched)
        history_before = guard.clip.state_dict()
        result = guard.step(nn.functional.mse_loss(model(x), y), batch=(x, y))
        if i == 3:
            assert (
                result.outcome is Outcome.NONFINITE and result.skipped and "non-finite loss" in result.reason
            )
            assert_identical(
                before, everything(model, opt, sched)
            )  # weights, BatchNorm buffers, moments, schedule
            assert_identical(history_before, guard.clip.state_dict())  # the AutoClip history too
            assert all(p.grad is None for p in model.parameters())
            saved = load_checkpoint(result.anomaly_path)
            assert torch.isnan(saved["anomaly"]["batch"][0]).any() and saved["step"] == 3
            assert_identical(saved["model"], before["model"])
            assert saved["anomaly"]["nonfinite_counts"] and "torch" in saved["rng"]
        else:
            assert not result.skipped
    assert guard.accepted == 5 and guard.budget.total == 1


@pytest.mark.parametrize("mode", list(MODES))
def test_a_taken_step_equals_the_plain_loop(mode):
    """The guard adds decisions, not arithmetic: its weights equal those of backward, clip, step by hand."""
    a, b = two_layer(), two_layer()
    opt_a, opt_b = (torch.optim.Adam(m.parameters(), 1e-2) for m in (a, b))
    guard = StepGuard(a, opt_a, clip=mode, **MODES[mode])
    history = AutoClipHistory()
    options = {**MODES[mode], "history": history} if mode == "autoclip" else MODES[mode]
    clipped = []
    for x, y in batches():
        clipped.append(guard.step(nn.functional.mse_loss(a(x), y)).clipped)
        opt_b.zero_grad()
        nn.functional.mse_loss(b(x), y).backward()
        clip_gradients_(b.parameters(), mode, **options)
        opt_b.step()
    assert_identical(a.state_dict(), b.state_dict())
    assert_identical(opt_a.state_dict(), opt_b.state_dict())
    assert any(clipped) == (mode != "none")  # the thresholds above clip at least once


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "gradscaler"])
def test_one_host_sync_per_taken_step(monkeypatch, scaled):
    """The accepted path reads the device once (loss, norm, finite flag, clip flag together): counted by
    patching every Tensor method that copies a value to the host. With a GradScaler too: the guard steps the
    optimizer itself, as scaler.step would read its found-inf flag a second time."""
    model = two_layer()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if scaled else None
    guard = StepGuard(model, opt, clip="norm", max_norm=0.5, scaler=scaler)
    data = batches()
    guard.step(nn.functional.mse_loss(model(data[0][0]), data[0][1]))  # warm-up (lazy optimizer state)
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            # Adam keeps its step counters on the CPU (also on CUDA) and reads them with item(): not a device
            # sync, and the same in a plain loop, so torch.optim's own calls are left out.
            if f"torch{os.sep}optim{os.sep}" not in sys._getframe(1).f_code.co_filename:
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    for x, y in data[1:]:
        loss = nn.functional.mse_loss(model(x), y)
        calls.clear()
        result = guard.step(loss)
        assert not result.skipped and result.clipped
        assert calls == ["tolist"], calls
    if scaled:  # the scaler still followed the steps: its growth tracker counted every one of them
        assert scaler.state_dict()["_growth_tracker"] == len(data)


def test_the_budget_stops_a_plain_loop(tmp_path):
    model = two_layer()
    guard = StepGuard(
        model, torch.optim.SGD(model.parameters(), 0.1), max_consecutive_skips=2, anomaly_dir=tmp_path
    )
    x, y = batches(1)[0]
    x[0, 0] = float("nan")
    for _ in range(2):
        assert guard.step(nn.functional.mse_loss(model(x), y), batch=(x, y)).skipped
    with pytest.raises(TrainingStopped, match="3 consecutive skipped steps exceed"):
        guard.step(nn.functional.mse_loss(model(x), y), batch=(x, y))
    assert len(list(tmp_path.glob("step-*.pt"))) == 3


def test_the_budget_can_leave_the_decision_to_the_caller():
    model = two_layer()
    guard = StepGuard(
        model, torch.optim.SGD(model.parameters(), 0.1), max_consecutive_skips=0, raise_on_exhausted=False
    )
    x, y = batches(1)[0]
    result = guard.step(nn.functional.mse_loss(model(x), y) * float("inf"))
    assert result.skipped and result.budget_exhausted.startswith("1 consecutive skipped steps exceed")
    assert result.anomaly_path is None  # no anomaly_dir: no checkpoint


def test_plain_loop_example_runs():
    proc = python_run([sys.executable, str(ROOT / "examples" / "plain_loop.py")], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LinearNet: step 3 skipped (non-finite loss" in proc.stdout
    assert "bit-identical" in proc.stdout and "CHANGED" not in proc.stdout
    assert proc.stdout.strip().endswith("OK: each NaN batch was skipped bit-exactly")


def test_state_dict_carries_the_budget_and_counts_to_a_new_guard():
    """A plain loop that checkpoints its guard resumes with the same skip budget, counters and step index."""
    model = two_layer()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    guard = StepGuard(model, opt, clip="autoclip", max_consecutive_skips=2)
    for x, y in batches(nan_at=3)[:4]:
        guard.step(nn.functional.mse_loss(model(x), y))
    state = guard.state_dict()
    resumed = StepGuard(model, opt, clip="autoclip", max_consecutive_skips=2)
    resumed.load_state_dict(state)
    assert resumed.steps == 4 and resumed.accepted == 3 and resumed.budget.consecutive == 1
    assert_identical(resumed.clip.state_dict(), guard.clip.state_dict())
    x, y = batches(1)[0]
    x[0, 0] = float("nan")
    resumed.step(nn.functional.mse_loss(model(x), y))  # the second skip in a row: within the budget of 2
    with pytest.raises(TrainingStopped, match="3 consecutive skipped steps"):
        resumed.step(nn.functional.mse_loss(model(x), y))


def test_a_first_release_state_dict_still_loads():
    """The guard's state_dict once kept `counts` and `anomaly_checkpoints` apart; such a file loads the same."""
    model = two_layer()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    guard = StepGuard(model, opt, clip="norm")
    for x, y in batches(nan_at=1)[:3]:
        guard.step(nn.functional.mse_loss(model(x), y))
    state = guard.state_dict()
    counters = state.pop("counters")
    old = {**state, "anomaly_checkpoints": counters.pop("anomaly_checkpoints"), "counts": counters}
    resumed = StepGuard(model, opt, clip="norm")
    resumed.load_state_dict(old)
    assert resumed.counters() == guard.counters() and resumed.accepted == 2


def guarded_state(model, opt, sched, guard):
    """Everything a skip must leave as it was: weights and BatchNorm buffers, optimizer moments and step
    counters, the schedule, the AutoClip history, the spike window and the guard's counters."""
    return copy.deepcopy(
        {
            **everything(model, opt, sched),
            "history": guard.clip.state_dict(),
            "spikes": guard.spikes.state_dict() if guard.spikes is not None else None,
            "counters": guard.counters(),
        }
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_a_nonfinite_gradient_with_a_finite_loss_is_skipped_bit_exactly(mode, tmp_path):
    """The gradient branch of the guard: the loss is finite, one gradient tensor holds an Inf (a hook on the
    output layer's weight, as an op whose backward overflows would leave it)."""
    model = two_layer()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    guard = StepGuard(model, opt, scheduler=sched, clip=mode, **MODES[mode], anomaly_dir=tmp_path)
    poison = [False]

    def inf_into_one_value(grad):
        if not poison[0]:
            return grad
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    model[3].weight.register_hook(inf_into_one_value)
    data = batches()
    for x, y in data[:3]:  # three taken steps: Adam has moments and step counters, AutoClip a history
        assert not guard.step(nn.functional.mse_loss(model(x), y)).skipped
    before = guarded_state(model, opt, sched, guard)
    poison[0] = True
    x, y = data[3]
    loss = nn.functional.mse_loss(model(x), y)
    assert torch.isfinite(loss)
    result = guard.step(loss, batch=(x, y))
    assert result.outcome is Outcome.NONFINITE and result.counted
    assert result.reason == "non-finite gradients (1 gradient tensors non-finite)"
    assert result.loss == float(loss.detach()) and result.grad_norm == float("inf")
    counters = guard.counters()
    assert counters.pop("anomaly_checkpoints") == 1
    before["counters"].pop("anomaly_checkpoints")
    assert_identical(before, {**guarded_state(model, opt, sched, guard), "counters": counters})
    assert all(p.grad is None for p in model.parameters())
    assert guard.steps == 4 and guard.budget.total == guard.budget.nonfinite == 1
    saved = load_checkpoint(result.anomaly_path)
    assert saved["anomaly"]["nonfinite_counts"] == {"3.weight": 1}
    assert_identical(saved["model"], before["model"])
    poison[0] = False
    x, y = data[4]
    assert not guard.step(nn.functional.mse_loss(model(x), y)).skipped  # and training goes on
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_a_spike_is_skipped_bit_exactly():
    """A finite loss far above the window of accepted losses: skipped like a NaN, nothing moves, and the spike
    does not join the window."""
    model = two_layer()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    spikes = SpikeDetector(window=8, zscore=4.0, warmup=4)
    guard = StepGuard(model, opt, scheduler=sched, clip="autoclip", spikes=spikes)
    data = batches(8)
    for x, y in data[:5]:
        assert not guard.step(nn.functional.mse_loss(model(x), y)).skipped
    assert len(spikes.losses) == 5
    before = guarded_state(model, opt, sched, guard)
    x, y = data[5]
    result = guard.step(nn.functional.mse_loss(model(x), 100.0 * y))  # targets 100x off: a loss spike
    assert result.outcome is Outcome.SPIKE and result.counted and result.reason.startswith("loss spike")
    assert math.isfinite(result.loss) and math.isfinite(result.grad_norm)
    assert_identical(before, guarded_state(model, opt, sched, guard))
    assert all(p.grad is None for p in model.parameters())
    assert guard.steps == 6 and guard.budget.spikes == 1 and guard.budget.nonfinite == 0
    x, y = data[6]
    assert not guard.step(nn.functional.mse_loss(model(x), y)).skipped


def test_an_fp16_overflow_is_skipped_bit_exactly_by_the_scaler():
    """fp16 autocast with a CPU GradScaler whose scale is too high: the scaled gradients overflow float16, the
    loss stays finite, and the guard leaves the step to the scaler (not counted against the budget): nothing
    moves but the scale, which halves."""
    model = two_layer()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = StepGuard(model, opt, scheduler=sched, clip="autoclip", scaler=scaler)

    def loss_of(x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        return nn.functional.mse_loss(out.float(), y)

    data = batches()
    for x, y in data[:3]:
        assert not guard.step(loss_of(x, y)).skipped
    scaler.update(new_scale=2.0**40)  # a scale grown too far: x 2^40 overflows float16's 65504
    before = guarded_state(model, opt, sched, guard)
    x, y = data[3]
    loss = loss_of(x, y)
    result = guard.step(loss)
    assert result.outcome is Outcome.SCALER and result.skipped and not result.counted
    assert result.reason.startswith("non-finite gradients") and result.loss == float(loss.detach())
    counters = guard.counters()
    assert counters["scaler_skips"] == 1 and before["counters"]["scaler_skips"] == 0
    counters["scaler_skips"] = 0
    assert_identical(before, {**guarded_state(model, opt, sched, guard), "counters": counters})
    assert all(p.grad is None for p in model.parameters())
    assert scaler.get_scale() == 2.0**39 and guard.budget.total == 0
