"""Anomaly checkpoints from real train.py runs, and their replay: the first non-finite module and op, NaN and Inf."""

import copy
import json
import math
import sys

import pytest
import torch
import torch.nn as nn
from conftest import ROOT, TINY, assert_identical, build_trainer, python_run, run_train
from omegaconf import OmegaConf

from wapstable.checkpoint import load_checkpoint, rng_state
from wapstable.cli import replay_anomaly
from wapstable.errors import UserError
from wapstable.model.wap import build_model
from wapstable.stability.replay import replay, summarize, trace_nonfinite

SHORT = ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.checkpoint_every=4", "fault.step=1"]
NAIVE = ["model.attention.stable=false", "fault=attention_overflow", "guard.max_consecutive_skips=10", *SHORT]


def replay_script(*args):
    """The script as a user runs it: a process of its own."""
    return python_run([sys.executable, str(ROOT / "scripts" / "replay_anomaly.py"), *args], timeout=300)


def script_main(capsys, *args):
    """The script's main() (wapstable/cli/replay_anomaly.py) in this process (no second torch import): exit code,
    stdout, stderr."""
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        code = replay_anomaly.main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)  # main() takes the run's thread count
    out, err = capsys.readouterr()
    return code, out, err


def metrics(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("nan_input")
    run_train(["fault=nan_input", *SHORT], run_dir, cache_dir)
    return run_dir


@pytest.fixture(scope="module")
def naive_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("naive_attention")
    run_train(NAIVE, run_dir, cache_dir)
    return run_dir


def test_nan_input_is_skipped_and_replay_names_the_first_conv(nan_run, capsys):
    m = metrics(nan_run)
    assert m["steps"] == 4 and m["skipped_steps"] == 1 and m["anomaly_checkpoints"] == 1
    path = nan_run / "anomalies" / "step-1.pt"
    raw = torch.load(path, weights_only=True)["state"]  # plain data: loads without running code
    a = raw["anomaly"]
    assert a["step"] == 1 and "non-finite" in a["reason"]
    assert torch.isfinite(a["batch"]["images"]).all()  # saved before the fault: replay must re-apply it
    assert a["batch"]["targets"].shape[0] == len(a["batch"]["ids"]) > 0
    assert {"rng", "config", "model", "vocab"} <= set(raw) and raw["config"]["fault"]["name"] == "nan_input"
    last = load_checkpoint(nan_run / "checkpoints" / "last.pt")
    assert all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())

    # The first conv of the watcher, found from the model itself rather than spelled out.
    model = build_model(OmegaConf.create(raw["config"]).model, len(raw["vocab"]))
    first_conv = next(n for n, mod in model.named_modules() if isinstance(mod, nn.Conv2d))
    proc = replay_script(path)
    assert proc.returncode == 1, proc.stderr
    assert "REPRODUCED" in proc.stdout and f"first non-finite module output: {first_conv}" in proc.stdout
    code, out, err = script_main(capsys, path, "--json")
    assert code == 1, err
    report = json.loads(out)
    assert report["reproduced"] and report["origin"] == "forward"
    assert report["first_forward_module"] == first_conv
    # The same bad values as in training; that the replay recomputes the trainer's step bit for bit (weights,
    # RNG, batch) is test_replay_recomputes_the_trainers_step_bit_for_bit's.
    assert report["nonfinite_grads"] == a["nonfinite_counts"]
    assert report["first_forward_module_inputs"]["nan"] == 1  # the one NaN pixel of the fault
    assert report["nonfinite_input_values"] == 1
    assert report["batch_ids"] == [str(i) for i in a["batch"]["ids"]]
    assert m["localization"]["first_forward_module"] == first_conv


def test_naive_attention_overflow_is_localised_to_exp(naive_run, capsys):
    m = metrics(naive_run)
    assert m["skipped_steps"] >= 1 and m["anomaly_checkpoints"] >= 1
    path = naive_run / "anomalies" / "step-1.pt"
    assert path.is_file()
    # The run localised its first anomaly itself.
    loc = m["localization"]
    assert loc["checkpoint"].endswith("step-1.pt") and loc["reproduced"]
    assert loc["first_forward_module"] == "parser.attention"
    assert loc["first_forward_op"] == "aten.exp.default" and loc["first_forward_op_kind"] == "inf"
    assert loc["first_forward_op_module"] == "parser.attention"
    # exp overflowed because its inputs (the scaled energies) went past float32's e^88.7.
    assert loc["first_forward_op_inputs"]["max"] > 88.7 and loc["attention_energies"]["max"] > 88.7

    proc = replay_script(path)
    assert proc.returncode == 1, proc.stderr
    assert "parser.attention" in proc.stdout and "aten.exp" in proc.stdout
    code, out, _ = script_main(capsys, path, "--json")
    report = json.loads(out)
    assert code == 1 and report["step"] == 1
    assert report["first_forward_module"] == "parser.attention" and "exp" in report["first_forward_op"]
    saved = load_checkpoint(path)["anomaly"]["nonfinite_counts"]
    assert report["nonfinite_grads"] and report["nonfinite_grads"] == saved  # the training step, recomputed

    # The fix, applied on replay: the same batch, weights and RNG no longer give NaN.
    fixed = replay_script(path, "--json", "--set", "model.attention.stable=true")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    report = json.loads(fixed.stdout)
    assert (
        not report["reproduced"]
        and report["nonfinite_grads"] == {}
        and report["first_forward_module"] is None
    )
    assert report["overrides"] == {"model.attention.stable": True}


def test_stable_attention_survives_the_same_fault(tmp_path, cache_dir):
    run_train(
        [a for a in NAIVE if a != "model.attention.stable=false"] + ["model.attention.stable=true"],
        tmp_path,
        cache_dir,
    )
    m = metrics(tmp_path)
    assert m["skipped_steps"] == 0 and m["anomaly_checkpoints"] == 0 and m["localization"] is None
    assert not (tmp_path / "anomalies").exists()


def test_replay_in_process_keeps_caller_rng_and_checks_overrides(naive_run):
    state = load_checkpoint(naive_run / "anomalies" / "step-1.pt")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    report = replay(state)
    assert torch.equal(torch.rand(3), expected)  # replay set the saved RNG, then gave the caller's back
    assert report["reproduced"] and summarize(report).startswith("reproduced")
    assert "parser.attention" in summarize(report)
    json.dumps(report)  # plain data
    fixed = replay(state, overrides={"model.attention.stable": True})
    assert not fixed["reproduced"] and summarize(fixed).startswith("not reproduced")
    with pytest.raises(UserError, match="no key"):
        replay(state, overrides={"model.attention.stabel": True})


@pytest.mark.slow  # make test-all
def test_exit_2_for_files_that_are_not_anomaly_checkpoints(nan_run, tmp_path, capsys):
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((nan_run / "anomalies" / "step-1.pt").read_bytes()[:2000])
    for path, words in [
        (text, "checkpoint"),
        (truncated, "truncated"),
        (tmp_path / "missing.pt", "does not exist"),
        (nan_run / "checkpoints" / "last.pt", "not an anomaly checkpoint"),
    ]:
        code, out, err = script_main(capsys, path)
        assert code == 2, (path, out, err)
        assert words in err and "Traceback" not in err and out == ""
    proc = replay_script(nan_run / "checkpoints" / "last.pt")  # and once as a real process
    assert proc.returncode == 2 and "not an anomaly checkpoint" in proc.stderr
    with pytest.raises(UserError, match="not an anomaly checkpoint"):
        replay(load_checkpoint(nan_run / "checkpoints" / "last.pt"))


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_backward_inf_is_caught_where_detect_anomaly_is_silent():
    # sqrt(0) = 0 is finite, its gradient 1/(2 sqrt(0)) is +inf: Inf and no NaN anywhere.
    model = nn.Sequential(nn.Linear(2, 2), Sqrt())
    nn.init.zeros_(model[0].weight)
    nn.init.zeros_(model[0].bias)
    x = torch.ones(4, 2)
    with torch.autograd.detect_anomaly():  # torch checks NaN only: no error
        model(x).sum().backward()
    assert torch.isinf(model[0].weight.grad).all() and not torch.isnan(model[0].weight.grad).any()

    report = trace_nonfinite(model, lambda: model(x).sum())
    assert report["reproduced"] and report["origin"] == "backward"
    assert report["first_forward_module"] is None and report["first_forward_op"] is None
    assert report["first_backward_op"] == "SqrtBackward0" and report["first_backward_op_kind"] == "inf"
    assert report["first_backward_module"] == "1"  # the Sqrt module: finite gradient in, Inf out
    assert report["nonfinite_grads"] == {"0.weight": 4, "0.bias": 2}


def test_forward_op_and_module_are_named_inside_a_module():
    # exp(100) overflows float32 inside the second module; the first op of the NaN that follows is not blamed.
    model = nn.Sequential(nn.Identity(), Exp())
    x = torch.tensor([1.0, 100.0], requires_grad=True)
    report = trace_nonfinite(model, lambda: (model(x) - model(x)).sum())  # inf - inf = NaN
    assert report["first_forward_module"] == "1" and report["first_forward_module_kind"] == "inf"
    assert report["first_forward_module_inputs"]["max"] == 100.0
    assert report["first_forward_op"] == "aten.exp.default" and report["first_forward_op_kind"] == "inf"
    assert report["first_forward_op_module"] == "1"
    assert report["origin"] == "forward" and report["reproduced"]


def test_replay_recomputes_the_trainers_step_bit_for_bit(tmp_path, cache_dir):
    """The anomaly checkpoint holds the trainer's weights, optimizer state and RNG from just before the step, and
    its replay recomputes that step exactly. A twin run without the fault takes the same step: with the fault
    removed on replay (`fault.name=none`), the replay's loss and gradient norm equal the twin's bit for bit. With
    dropout on, a wrong RNG state changes the masks and so the loss; a wrong weight changes both."""
    common = [*TINY, "model.dropout=0.3", "guard.localize=false", "logger=[]", "trainer.max_steps=4"]

    def trainer(name, *overrides):
        return build_trainer([*common, *overrides], tmp_path / name, cache_dir)

    faulty = trainer("faulty", "fault=nan_input", "fault.step=2")
    results = [faulty.train_one() for _ in range(3)]
    assert [r.skipped for r in results] == [False, False, True]
    saved = load_checkpoint(results[2].anomaly_path)

    twin = trainer("twin", "fault=none")
    before = {}
    train_step = twin.train_step

    def spy(batch, rng_before=None):  # the twin's state and RNG as its step 2 begins its forward
        if twin.step == 2:
            before.update(
                model=copy.deepcopy(twin.model.state_dict()),
                optimizer=copy.deepcopy(twin.optimizer.state_dict()),
                rng=rng_state(),
                ids=[str(i) for i in batch.ids],
            )
        return train_step(batch, rng_before)

    twin.train_step = spy
    taken = [twin.train_one() for _ in range(3)][2]
    assert not taken.skipped and math.isfinite(taken.loss)

    assert_identical(saved["model"], before["model"], "model")  # weights and BatchNorm statistics
    assert_identical(saved["optimizer"], before["optimizer"], "optimizer")
    assert torch.equal(saved["rng"]["torch"], before["rng"]["torch"])  # what dropout draws from
    report = replay(saved, overrides={"fault.name": "none"})
    assert not report["reproduced"] and report["batch_ids"] == before["ids"]
    assert report["loss"] == taken.loss and report["grad_norm"] == taken.grad_norm
    # The same checkpoint with the fault left on reproduces the anomaly.
    assert replay(saved)["reproduced"]
