"""The real train.py, end to end on tiny data: the run's files, resume equality, refusals."""

import json

import pytest
import torch
from conftest import run_train


def weights(path):
    return torch.load(path, weights_only=True)["state"]["model"]


def test_smoke_run_writes_the_run_files(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train(["optim=adam_cosine"], run, cache_dir)  # the default optimizer and schedule
    for name in [
        "train.log",
        "metrics.json",
        "vocab.txt",
        "checkpoints/last.pt",
        "checkpoints/best.pt",
        ".hydra/config.yaml",
    ]:
        assert (run / name).is_file(), name
    assert list((run / "tb").glob("events.out.tfevents.*"))
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["skipped_steps"] == 0
    for key in ("wall_time_s", "best_valid_exprate", "final_valid_exprate", "test_exprate", "clip_fraction"):
        assert key in metrics
    assert (run / "vocab.txt").read_text().startswith("<eol>\t0\n")
    assert "valid ExpRate" in (run / "train.log").read_text()
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert (
        state["step"] == 3 and state["vocab"][0] == "<eol>" and state["config"]["trainer"]["max_steps"] == 3
    )
    assert (
        state["config"]["optim"]["schedule"] == "cosine"
        and state["config"]["data"]["batch"]["bucket_by"] == "tokens"
    )
    assert {"python", "numpy", "torch"} <= set(state["rng"])


def test_resume_gives_bit_identical_weights(tmp_path, cache_dir):
    common = ["model.dropout=0.3", "trainer.eval_every=3", "trainer.checkpoint_every=3", "optim=adam"]
    straight = tmp_path / "straight"
    run_train([*common, "trainer.max_steps=6"], straight, cache_dir)
    first = tmp_path / "first"
    run_train([*common, "trainer.max_steps=3"], first, cache_dir)
    second = tmp_path / "second"
    run_train(["trainer.max_steps=6", f"resume={first / 'checkpoints' / 'last.pt'}"], second, cache_dir)
    a, b = weights(straight / "checkpoints" / "last.pt"), weights(second / "checkpoints" / "last.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the resumed run took its config from the checkpoint (dropout, adam) and its steps from the command line
    state = torch.load(second / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert (
        state["step"] == 6
        and state["config"]["optim"]["name"] == "adam"
        and state["config"]["model"]["dropout"] == 0.3
    )


def test_resume_refuses_another_model_size(tmp_path, cache_dir):
    first = tmp_path / "first"
    run_train([], first, cache_dir)
    last = first / "checkpoints" / "last.pt"
    before = last.read_bytes()
    proc = run_train([f"resume={last}", "model.hidden_dim=24"], tmp_path / "second", cache_dir, check=False)
    assert proc.returncode == 2
    assert "another size" in proc.stderr + proc.stdout and "model config" in proc.stderr + proc.stdout
    assert last.read_bytes() == before


def test_time_budget_ends_the_run_and_its_schedule(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = run_train(
        [
            "trainer.max_steps=100000",
            "trainer.eval_every=100000",
            "trainer.checkpoint_every=100000",
            "trainer.max_minutes=0.05",
            "optim=adam",
            "optim.schedule=cosine",
        ],
        run,
        cache_dir,
    )
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["stopped_by_time"] and 0 < metrics["steps"] < 100000
    assert metrics["evals"][-1]["step"] == metrics["steps"]  # evaluated and saved where it stopped
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert state["step"] == metrics["steps"]
    assert "trainer.max_minutes=0.05 spent" in proc.stdout + proc.stderr
    # the cosine reached its end with the budget, far from step 100000
    assert state["optimizer"]["param_groups"][0]["lr"] < 1e-3 * 0.05


def test_cosine_follows_whichever_budget_runs_out_first():
    from wapstable.config import OptimConfig
    from wapstable.train.optim import lr_factor

    cfg = OptimConfig(schedule="cosine", warmup_steps=10)
    assert lr_factor(cfg, 4, 1000) == 0.5  # warm-up counts steps whatever the clock says
    assert lr_factor(cfg, 4, 1000, time_done=0.9) == 0.5
    assert lr_factor(cfg, 10, 1000) == 1.0
    assert abs(lr_factor(cfg, 10, 1000, time_done=0.5) - 0.5) < 1e-9
    assert lr_factor(cfg, 10, 1000, time_done=1.0) < 1e-12
    assert abs(lr_factor(cfg, 505, 1000, time_done=0.1) - 0.5) < 1e-9  # steps ahead of time


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_resume_refuses_another_optimizer(tmp_path, cache_dir):
    first = tmp_path / "first"
    run_train(["optim=adam"], first, cache_dir)
    last = first / "checkpoints" / "last.pt"
    before = last.read_bytes()
    proc = run_train([f"resume={last}", "optim=adadelta"], tmp_path / "second", cache_dir, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "holds the state of optimizer adam, not optim.name=adadelta" in proc.stderr + proc.stdout
    assert last.read_bytes() == before and not (tmp_path / "second" / "checkpoints").exists()


def test_the_step_schedule_through_train_py(tmp_path, cache_dir):
    """optim.schedule=step: the lr falls by optim.gamma every optim.step_size steps, as metrics.csv logs it."""
    from test_loggers import read_csv

    run = tmp_path / "run"
    args = [
        "optim.schedule=step",
        "optim.step_size=2",
        "optim.gamma=0.5",
        "trainer.max_steps=5",
        "logger=csv",
    ]
    run_train(args, run, cache_dir)
    assert read_csv(run / "metrics.csv")["train/lr"] == {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5, 5: 0.25}
