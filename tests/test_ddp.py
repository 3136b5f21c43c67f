"""Multi-process training: real `torchrun` runs of train.py with 2 CPU processes (gloo), and the collectives alone."""

import csv
import json
import math
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, python_run

from wapstable.checkpoint import load_checkpoint
from wapstable.data.batches import BatchStream
from wapstable.data.sample import Sample
from wapstable.data.vocab import Vocab
from wapstable.errors import TrainingStopped, UserError
from wapstable.train.distributed import Dist, setup, torchrun_argv

CHECKSUM = re.compile(r"step (\d+): weights identical on 2 ranks \(checksum (\w+)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args, run_dir, cache_dir, timeout=300):
    """`torchrun --nproc_per_node=2 train.py trainer.ddp=true` on the CPU with tiny settings into `run_dir`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(ROOT / "train.py"),
        *TINY,
        f"hydra.run.dir={run_dir}",
        "trainer.ddp=true",
        "trainer.device=cpu",
        "hydra.verbose=wapstable.train.distributed",  # each rank logs its own weight checksum at every check
        *args,
    ]
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), "HYDRA_FULL_ERROR": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def checksums(log) -> dict[int, str]:
    """step -> the weight checksum a rank logged (its own, computed before the all-gather)."""
    return {int(s): c for s, c in CHECKSUM.findall(log.read_text())}


def csv_steps(path) -> list[int]:
    with open(path, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def explain(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


NAN_ON_RANK1 = [
    "fault=nan_input",
    "fault.rank=1",
    "fault.step=1",
    "trainer.max_steps=4",
    "trainer.consistency_every=1",
    "logger=[tensorboard,csv]",
]


def nan_on_rank1_run(run, cache_dir) -> None:
    """A 2-rank run with a NaN batch on rank 1 at step 1: skipped on both ranks, one anomaly checkpoint naming the
    rank, the replay reproducing it, identical weights on both ranks, rank 1 writing only its log."""
    proc = torchrun([*NAN_ON_RANK1, "trainer.threads=auto"], run, cache_dir)
    assert proc.returncode == 0, explain(proc)

    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["skipped_steps"] == 1
    # trainer.threads=auto: the two ranks share the cores (LOCAL_WORLD_SIZE=2)
    assert f"; {max(1, len(os.sched_getaffinity(0)) // 2)} threads" in (run / "train.log").read_text()
    # The checkpoint names the rank that saw the NaN and holds its batch, so the replay reproduces it.
    anomaly = load_checkpoint(run / "anomalies" / "step-1.pt")["anomaly"]
    assert anomaly["ranks"] == [1] and anomaly["batch_rank"] == 1
    assert not math.isfinite(anomaly["loss"])
    assert metrics["localization"]["reproduced"]

    rank0, rank1 = run / "train.log", run / "train.rank1.log"
    assert "step 1 skipped" in rank0.read_text() and "step 1 skipped" in rank1.read_text()
    # Weights identical on both ranks at every step, by each rank's own checksum (step 0 = before training).
    assert checksums(rank0) == checksums(rank1)
    assert sorted(checksums(rank0)) == [0, 1, 2, 3, 4]
    # Rank 1 writes its log and nothing else: one TensorBoard file, one metrics.csv row per step.
    assert len(list((run / "tb").iterdir())) == 1
    assert csv_steps(run / "metrics.csv") == [1, 2, 3, 4]
    assert [p.name for p in run.rglob("*rank1*")] == ["train.rank1.log"]


def test_nan_on_rank1_skips_on_both_ranks(tmp_path, cache_dir):
    nan_on_rank1_run(tmp_path / "run", cache_dir)


@pytest.mark.slow
def test_nan_on_rank1_skips_on_both_ranks_and_resumes(tmp_path, cache_dir):
    run = tmp_path / "run"
    nan_on_rank1_run(run, cache_dir)
    rank0, rank1 = run / "train.log", run / "train.rank1.log"
    # Resume from last.pt, with two more faulty steps on rank 1 and room for one more anomaly checkpoint: every rank
    # must agree on whether to write one (the count is kept on every rank, not only on rank 0).
    more = [
        "resume=auto",
        "trainer.max_steps=7",
        "fault.step=4",
        "fault.steps=2",
        "guard.max_anomaly_checkpoints=2",
    ]
    proc = torchrun([*NAN_ON_RANK1[:3], *more, "trainer.consistency_every=1"], run, cache_dir)
    assert proc.returncode == 0, explain(proc)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 7 and metrics["skipped_steps"] == 3 and metrics["anomaly_checkpoints"] == 2
    assert [a["ranks"] for a in metrics["anomalies"]] == [[1], [1]]
    assert "resuming from" in rank1.read_text()
    assert checksums(rank0) == checksums(rank1)
    assert {4, 5, 6, 7} <= set(checksums(rank0))
    assert csv_steps(run / "metrics.csv") == list(range(1, 8))  # the checkpoint's logger config, appended to


@pytest.mark.slow  # make test-all; make test keeps test_nan_on_rank1_skips_on_both_ranks and the collectives
def test_diverged_replicas_stop_the_run(tmp_path, cache_dir):
    # lr_spike on rank 1 only: that rank steps with another lr, the weights part, the check stops the run.
    run = tmp_path / "run"
    args = [
        "fault=lr_spike",
        "fault.rank=1",
        "fault.step=1",
        "trainer.max_steps=4",
        "trainer.consistency_every=2",
    ]
    proc = torchrun(args, run, cache_dir)
    assert proc.returncode != 0
    for log in ("train.log", "train.rank1.log"):
        text = (run / log).read_text()
        assert "stopped: step 2: the weights differ across ranks" in text, text[-2000:]
        assert "rank(s) [1]" in text
    assert not (run / "metrics.json").exists()


def _collectives_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    """One of two gloo processes: the consistency check, the per-rank gradient flag, the broadcast."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    d = Dist(rank, world)
    out = {}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    d.check_consistency(model, step=1)  # identical: passes
    saved = model.weight.detach().clone()
    if rank == 1:  # one weight, one ulp apart: a float sum could miss it, the bit sum does not
        with torch.no_grad():
            model.weight[1, 2] = torch.nextafter(model.weight[1, 2], torch.tensor(math.inf))
    try:
        d.check_consistency(model, step=2)
    except TrainingStopped as e:
        out["weights"] = str(e)
    with torch.no_grad():
        model.weight.copy_(saved)
    try:
        d.check_consistency(model, step=10 if rank == 0 else 0)  # as if rank 1 had not found the checkpoint
    except TrainingStopped as e:
        out["steps"] = str(e)

    # A finite loss whose gradient is Inf on rank 1 only (d sqrt(x)/dx at 0); after DDP averages, Inf everywhere.
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    ddp = d.wrap(net)
    loss = ddp(torch.ones(2, 4)).sum()
    if rank == 1:
        loss = loss + torch.sqrt(net.bias - net.bias.detach()).sum()
    loss.backward()
    d.any(torch.tensor(False))  # closes the step's record of this rank's own gradients
    out["loss_finite"] = bool(torch.isfinite(loss))
    out["grad_finite"] = bool(torch.isfinite(net.bias.grad).all())
    out["local"] = d.local_grads_nonfinite
    out["ranks"] = d.ranks_with(d.local_grads_nonfinite)
    out["from1"] = d.from_rank(1, {"rank": rank} if rank == 1 else None)
    out["agree"] = d.agree(rank == 1)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    del ddp  # its reducer must go before the group it talks through
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can abort the interpreter's own teardown ("terminate called without an active exception",
    # torch 2.14): the results are written, so leave without it, as train.py does under torchrun.
    os._exit(0)


def test_collectives_find_mismatches_and_the_rank_that_saw_nan(tmp_path):
    torch.multiprocessing.spawn(
        # TCP rendezvous on loopback: a file store can abort a rank that tears down while the other still reads it
        _collectives_worker,
        args=(2, f"tcp://127.0.0.1:{free_port()}", str(tmp_path)),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "step 2: the weights differ across ranks" in r["weights"]
        assert "1 of 2 parameter tensors (first weight)" in r["weights"] and "rank(s) [1]" in r["weights"]
        assert "different steps (rank 0: 10, rank 1: 0)" in r["steps"]
        assert r["loss_finite"] and not r["grad_finite"]
        assert r["ranks"] == [1] and r["from1"] == {"rank": 1} and r["agree"]
    assert [r["local"] for r in results] == [False, True]


def test_single_process_dist_is_a_no_op():
    d = Dist()
    model = torch.nn.Linear(2, 2)
    assert d.wrap(model) is model and not d.should_check(10, 10)
    d.check_consistency(model, 3)
    assert d.agree(True) and d.ranks_with(True) == [0] and d.from_rank(0, "x") == "x"
    assert bool(d.any(torch.tensor(True)))


def test_setup_refuses_half_configured_ddp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="add trainer.ddp=true"):
        setup(ddp=False)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UserError, match="needs torchrun"):
        setup(ddp=True)


def test_torchrun_argv(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    argv = ["train.py", "trainer.ddp=true", "hydra.run.dir=outputs/x"]
    assert torchrun_argv(argv) == argv
    monkeypatch.setenv("RANK", "1")
    extra = torchrun_argv(argv)[len(argv) :]
    assert "hydra.output_subdir=null" in extra
    assert any(a.endswith(".rank1.log") for a in extra)
    # Library code raises; the entry point (wapstable/cli/train.py) prints the sentence and exits 2.
    with pytest.raises(UserError, match="add hydra.run.dir=outputs/NAME"):
        torchrun_argv(["train.py", "trainer.ddp=true"])
    with pytest.raises(UserError, match="start sweeps without torchrun"):
        torchrun_argv(["train.py", "-m", "hydra.run.dir=x"])


def test_batches_are_split_across_ranks_without_overlap():
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            f"s{i}",
            rng.integers(0, 255, (int(rng.integers(8, 40)), int(rng.integers(8, 80))), np.uint8),
            ["a"],
        )
        for i in range(61)
    ]
    vocab = Vocab(["<eol>", "a"])
    streams = [BatchStream(samples, vocab, 4000, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    n = len(streams[0].batches)
    for epoch in range(3):
        orders = [s.epoch_order(epoch) for s in streams]
        assert len(orders[0]) == len(orders[1]) == n // 2
        assert not set(orders[0]) & set(orders[1])
    # What the ranks actually train on in one epoch: disjoint sets of samples, the same number of batches.
    seen = [[i for _ in range(len(s)) for i in s.next().ids] for s in streams]
    assert not set(seen[0]) & set(seen[1])


def test_torchrun_without_a_run_directory_is_one_sentence_and_exit_2(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}  # as torchrun sets them
    proc = python_run(
        [sys.executable, str(ROOT / "train.py"), "trainer.ddp=true"], cwd=tmp_path, env=env, timeout=300
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: under torchrun every rank must write to the same run directory" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_average_of_the_weights_under_ddp(tmp_path, cache_dir):
    """trainer.ema_decay on 2 ranks: the skip on rank 1 leaves the average on both (3 updates of 4 steps), and what
    the run reads (its test, evaluate.py's load) is the average rank 0 saved."""
    run = tmp_path / "run"
    proc = torchrun([*NAN_ON_RANK1, "trainer.ema_decay=0.5"], run, cache_dir)
    assert proc.returncode == 0, explain(proc)
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    assert last["ema"]["updates"] == 3 and last["counters"]["accepted"] == 3
    model, average = last["model"], last["ema"]["weights"]
    assert any(not torch.equal(model[k], average[k]) for k in model if model[k].is_floating_point())
    assert checksums(run / "train.log") == checksums(run / "train.rank1.log")
