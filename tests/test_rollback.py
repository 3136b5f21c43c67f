"""guard.on_budget_exhausted=rollback through the real train.py: restore, back off, carry on, within bounds."""

import json

import torch
from conftest import run_train

SPIKE = [
    "fault=lr_spike",
    "fault.step=4",
    "trainer.max_steps=14",
    "trainer.eval_every=14",
    "trainer.checkpoint_every=10",
    "guard.max_consecutive_skips=2",
    "guard.snapshot_every=2",
    "guard.localize=false",
]


def test_stop_exits_nonzero_with_anomaly_checkpoint(tmp_path, cache_dir):
    run = tmp_path / "stop"
    proc = run_train([*SPIKE, "guard.on_budget_exhausted=stop"], run, cache_dir, check=False)
    assert proc.returncode == 3
    assert "exceed guard.max_consecutive_skips=2" in proc.stderr + proc.stdout
    assert list((run / "anomalies").glob("step-*.pt"))
    assert not (run / "metrics.json").exists()


def test_rollback_recovers_and_is_recorded(tmp_path, cache_dir):
    run = tmp_path / "rollback"
    proc = run_train([*SPIKE, "guard.on_budget_exhausted=rollback"], run, cache_dir)
    out = proc.stdout + proc.stderr
    assert "ROLLBACK 1/3" in out and "NOT A CLEAN RUN" in out
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 14
    [event] = metrics["rollbacks"]
    assert event["step"] == 7 and event["restored_step"] < 5  # before the spike at step 4 did its damage
    assert event["lr"] == 0.5 and event["clip_threshold"] == 50.0  # adadelta lr 1.0 and max_norm 100, halved
    assert event["batches_skipped"] == event["step"] + 1 - event["restored_step"]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert state["rollback"]["lr_scale"] == 0.5 and state["optimizer"]["param_groups"][0]["lr"] == 0.5

    # A resumed run keeps its rollback count and back-off.
    resumed = tmp_path / "resumed"
    run_train([f"resume={run / 'checkpoints' / 'last.pt'}", "trainer.max_steps=16"], resumed, cache_dir)
    state = torch.load(resumed / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert state["step"] == 16 and len(state["rollback"]["events"]) == 1
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.5
    assert json.loads((resumed / "metrics.json").read_text())["rollbacks"][0]["step"] == 7


def test_max_rollbacks_is_honoured(tmp_path, cache_dir):
    run = tmp_path / "bounded"
    args = [
        "fault=nan_input",  # fails for 40 steps in a row: no rollback can outrun it
        "fault.step=2",
        "fault.steps=40",
        "trainer.max_steps=40",
        "guard.max_consecutive_skips=1",
        "guard.snapshot_every=1",
        "guard.max_rollbacks=2",
        "guard.on_budget_exhausted=rollback",
        "guard.localize=false",
    ]
    proc = run_train(args, run, cache_dir, check=False)
    assert proc.returncode == 3
    out = proc.stderr + proc.stdout
    assert "ROLLBACK 2/2" in out and "ROLLBACK 3/" not in out and "after 2 rollbacks" in out
