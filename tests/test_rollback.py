"""guard.on_budget_exhausted=rollback through the real train.py: restore, back off, carry on, within bounds."""

import copy
import json

import pytest
import torch
from conftest import TINY, assert_identical, build_trainer, run_multirun, run_train

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


def finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def rollback_sweep(args, sweep_dir, cache_dir):
    """Many rollback runs in one `train.py -m` process (each job a run directory under `sweep_dir`)."""
    common = [
        "fault=lr_spike",
        "trainer.eval_every=500",
        "guard.max_consecutive_skips=2",
        "guard.on_budget_exhausted=rollback",
        "guard.localize=false",
    ]
    run_multirun([*common, *args], sweep_dir, cache_dir)
    return sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault_steps,max_steps", [("0,1,4,49,50,51", 56), ("120", 124)], ids=["first-steps", "step-120"]
)
def test_rollback_always_has_a_trusted_state(tmp_path, cache_dir, fault_steps, max_steps):
    """An lr spike at any step, with checkpoints every 1, 2 or 500 steps and snapshots every 1 or 50: the run
    rolls back to a state from before the spike, ends with finite weights, and a resumed run keeps the back-off."""
    jobs = rollback_sweep(
        [
            f"fault.step={fault_steps}",
            "trainer.checkpoint_every=1,2,500",
            "guard.snapshot_every=1,50",
            f"trainer.max_steps={max_steps}",
        ],
        tmp_path / "sweep",
        cache_dir,
    )
    assert len(jobs) == len(fault_steps.split(",")) * 3 * 2
    for job in jobs:
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        spike = int(next(line for line in overrides.splitlines() if "fault.step=" in line).split("=")[1])
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["steps"] == max_steps, overrides
        [event] = metrics["rollbacks"]
        # The spike's own step is accepted and does the damage: the state it started from is the newest good one.
        assert event["restored_step"] <= spike < event["step"], (overrides, event)
        last = torch.load(job / "checkpoints" / "last.pt", weights_only=True)["state"]
        assert finite(last) and last["rollback"]["lr_scale"] == 0.5
        trusted = torch.load(job / "checkpoints" / "trusted.pt", weights_only=True)["state"]
        assert finite(trusted) and trusted["step"] <= last["step"]

    # A resumed run keeps the back-off (lr 0.5 of Adadelta's 1.0) and its rollback record.
    job = jobs[0]
    run_train(["resume=auto", f"trainer.max_steps={max_steps + 2}", f"hydra.run.dir={job}"], job, cache_dir)
    last = torch.load(job / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert last["step"] == max_steps + 2 and len(last["rollback"]["events"]) == 1
    assert last["optimizer"]["param_groups"][0]["lr"] == 0.5


def test_the_issue_command_rolls_back_to_the_spike_step(tmp_path, cache_dir):
    """A failure before the first snapshot, with checkpoints during the streak: a rollback, not a stop."""
    run = tmp_path / "early"
    args = [
        "fault=lr_spike",
        "fault.step=4",
        "trainer.max_steps=20",
        "trainer.eval_every=100",
        "trainer.checkpoint_every=2",
        "guard.max_consecutive_skips=2",
        "guard.on_budget_exhausted=rollback",
        "guard.localize=false",
    ]
    run_train(args, run, cache_dir)
    [event] = json.loads((run / "metrics.json").read_text())["rollbacks"]
    # Checkpoints at steps 4 and 6: step 4 (the spike's start) is trusted once step 4 is accepted; the one of
    # step 6 holds the damaged weights and never replaces it in trusted.pt.
    assert event["restored_step"] == 4 and event["source"] == "snapshot"
    trusted = torch.load(run / "checkpoints" / "trusted.pt", weights_only=True)["state"]
    assert finite(trusted) and trusted["step"] > 4  # the run went on and trusted newer states


def test_a_second_rollback_goes_further_back(tmp_path, cache_dir):
    run = tmp_path / "further"
    args = [
        "fault=nan_input",  # steps 4-9 fail: the first rollbacks cannot cure it
        "fault.step=4",
        "fault.steps=6",
        "trainer.max_steps=14",
        "trainer.eval_every=14",
        "trainer.checkpoint_every=14",
        "guard.max_consecutive_skips=1",
        "guard.snapshot_every=1",
        "guard.max_rollbacks=3",
        "guard.on_budget_exhausted=rollback",
        "guard.localize=false",
    ]
    run_train(args, run, cache_dir)
    events = json.loads((run / "metrics.json").read_text())["rollbacks"]
    restored = [e["restored_step"] for e in events]
    # Two newest snapshots (3, 2), then the starting state, the floor.
    assert restored == [3, 2, 0], events
    assert [e["source"] for e in events] == ["snapshot", "snapshot", "starting state"]


@pytest.mark.slow  # make test-all
def test_a_run_resumed_inside_a_failure_streak_returns_to_trusted_pt(tmp_path, cache_dir):
    """last.pt written mid-streak holds damaged weights; the resumed run rolls back to trusted.pt instead."""
    run = tmp_path / "midstreak"
    common = [
        "fault=lr_spike",
        "fault.step=4",
        "trainer.eval_every=100",
        "trainer.checkpoint_every=2",
        "guard.max_consecutive_skips=3",
        "guard.on_budget_exhausted=rollback",
        "guard.localize=false",
    ]
    run_train([*common, "trainer.max_steps=6"], run, cache_dir)  # ends at step 6, inside the streak
    last = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert last["rollback"]["streak_start"] == 5 and not last["rollback"]["events"]
    run_train([*common, "resume=auto", "trainer.max_steps=12"], run, cache_dir)
    [event] = json.loads((run / "metrics.json").read_text())["rollbacks"]
    assert event["restored_step"] == 4 and event["source"] == "trusted.pt"
    assert finite(torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"])


def test_a_rollback_restores_the_snapshot_bit_for_bit(tmp_path, cache_dir):
    """After a rollback the weights (BatchNorm statistics included), the optimizer's moments and step counters,
    the schedule's position and the AutoClip history are those of the step rolled back to, bit for bit: the
    same as a twin run stopped at that step. Only the back-off differs (the lr halved)."""
    common = [
        *TINY,
        *SPIKE,
        "guard.on_budget_exhausted=rollback",
        "clip=autoclip",
        "trainer.max_steps=10",
        "trainer.eval_every=10",
        "trainer.checkpoint_every=10",
        "decode.final_beam_size=1",
        "logger=[]",
    ]

    def trainer(name):
        return build_trainer(common, tmp_path / name, cache_dir)

    def training_state(t):
        return copy.deepcopy(
            {
                "model": t.model.state_dict(),
                "optimizer": t.optimizer.state_dict(),
                "clip": t.clip.state_dict(),
                "scheduler_steps": t.scheduler.state_dict()["last_epoch"],
            }
        )

    run = trainer("rollback")
    after = []
    roll_back = run.roll_back

    def spy(reason):  # the training state just after the rollback
        done = roll_back(reason)
        after.append(training_state(run))
        return done

    run.roll_back = spy
    metrics = run.fit()
    [event] = metrics["rollbacks"]
    assert event["step"] == 7 and event["restored_step"] == 4 and event["source"] == "snapshot"
    [restored] = after

    twin = trainer("twin")  # the same run, stopped before the spike's step
    for _ in range(event["restored_step"]):
        assert not twin.train_one().skipped
    want = training_state(twin)
    assert want["scheduler_steps"] == 4 and want["clip"]["history"]["count"] == 4
    for got, group in zip(restored["optimizer"]["param_groups"], want["optimizer"]["param_groups"]):
        assert got.pop("lr") == 0.5 * group.pop("lr")  # the back-off, the one intended difference
    assert_identical(restored, want)
