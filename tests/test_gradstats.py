"""grad_stats.csv holds the gradients' true figures, anomalous steps always land in it, and the report reads it."""

import csv
import math

import numpy as np
import pytest
import torch
from conftest import run_train
from omegaconf import OmegaConf

from wapstable.cli import grad_report
from wapstable.config import CONF_DIR, StatsConfig
from wapstable.errors import UserError
from wapstable.stability import AutoClipHistory
from wapstable.stability.clip import build_clip
from wapstable.stability.gradstats import CSV_NAME, GLOBAL, GradStats, validate_stats_config
from wapstable.stability.step_guard import Outcome, StepGuard, StepResult


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def stats_for(tmp_path, **kw):
    return GradStats(OmegaConf.structured(StatsConfig(**kw)), tmp_path)


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    torch.nn.functional.mse_loss(model(torch.randn(8, 5) * 10), torch.randn(8, 3)).backward()
    return model


def step_with_stats(stats, model, step, lr=0.1, skipped=False, anomalous=False):
    """What the trainer does: capture before the step, SGD step (unless skipped), finish."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = float(torch.nn.utils.get_total_norm(list(grads.values())))
    stats.capture(step, model, anomalous=anomalous)
    if not skipped:
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    outcome = Outcome.NONFINITE if skipped else Outcome.ACCEPTED
    stats.finish(step, StepResult(step, loss=1.5, grad_norm=total, outcome=outcome), threshold=lambda: 7.0)
    return grads, before


def test_csv_equals_norms_computed_from_the_gradients(tmp_path):
    model = small_model()
    stats = stats_for(tmp_path, every=1)
    grads, before = step_with_stats(stats, model, step=0)
    rows = {r["name"]: r for r in read_csv(tmp_path / CSV_NAME)}
    assert set(rows) == {n for n, _ in model.named_parameters()} | {GLOBAL}
    for name, p in model.named_parameters():
        g, r = grads[name], rows[name]
        assert float(r["grad_norm"]) == pytest.approx(float(g.norm()), rel=1e-6)
        assert float(r["grad_max_abs"]) == pytest.approx(float(g.abs().max()), rel=1e-6)
        assert float(r["grad_mean_abs"]) == pytest.approx(float(g.abs().mean()), rel=1e-6)
        assert int(r["nonfinite"]) == 0
        assert float(r["param_norm"]) == pytest.approx(float(p.detach().norm()), rel=1e-6)
        ratio = float((p.detach() - before[name]).norm() / p.detach().norm())
        assert float(r["update_ratio"]) == pytest.approx(ratio, rel=1e-5)
    g = rows[GLOBAL]
    all_grads = torch.cat([x.flatten() for x in grads.values()])
    assert float(g["grad_norm"]) == pytest.approx(float(all_grads.norm()), rel=1e-6)
    assert float(g["grad_max_abs"]) == pytest.approx(float(all_grads.abs().max()), rel=1e-6)
    assert float(g["grad_mean_abs"]) == pytest.approx(float(all_grads.abs().mean()), rel=1e-6)
    assert float(g["threshold"]) == 7.0 and g["clipped"] == "0" and g["skipped"] == "0"
    # Nothing clipped the gradients here, so the norm after clipping is the norm before.
    assert float(g["grad_norm_clipped"]) == pytest.approx(float(all_grads.norm()), rel=1e-6)


def test_every_and_anomalous_steps(tmp_path):
    model = small_model()
    stats = stats_for(tmp_path, every=0)  # off: only anomalous steps are written
    step_with_stats(stats, model, step=0)
    assert not (tmp_path / CSV_NAME).exists()
    model[0].weight.grad[0, :2] = float("nan")
    step_with_stats(stats, model, step=1, skipped=True, anomalous=True)
    rows = read_csv(tmp_path / CSV_NAME)
    assert {r["step"] for r in rows} == {"1"}
    by_name = {r["name"]: r for r in rows}
    assert int(by_name["0.weight"]["nonfinite"]) == 2 and int(by_name[GLOBAL]["nonfinite"]) == 2
    assert by_name[GLOBAL]["skipped"] == "1"
    assert all(float(r["update_ratio"]) == 0.0 for r in rows)  # a skipped step leaves the weights alone
    # A second writer (a resumed run) appends without a second header.
    stats = stats_for(tmp_path, every=2)
    model[0].weight.grad.zero_()
    for step in (2, 3, 4):
        step_with_stats(stats, model, step)
    steps = [r["step"] for r in read_csv(tmp_path / CSV_NAME)]
    assert sorted(set(steps)) == ["1", "2", "4"] and (tmp_path / CSV_NAME).read_text().count("step,name") == 1


def test_negative_interval_is_a_user_error():
    with pytest.raises(UserError, match="stats.every"):
        validate_stats_config(OmegaConf.structured(StatsConfig(every=-1)))


def test_threshold_in_force():
    """The guard's threshold in force, as grad_stats.csv records it: the configured one, after a rollback's
    back-off, and autoclip's percentile of the history."""
    history = AutoClipHistory(10)
    for x in (1.0, 2.0, 3.0, 4.0, 5.0):
        history.append(torch.tensor(x))
    model = torch.nn.Linear(2, 2)

    def threshold(scale=1.0, mode="norm", **kw):
        rule = build_clip({**OmegaConf.load(CONF_DIR / "clip" / f"{mode}.yaml"), **kw})
        if mode == "autoclip":
            rule.norms = history
        guard = StepGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=rule.backed_off(scale))
        return guard.clip_threshold()

    assert threshold(mode="norm", max_norm=8.0) == 8.0
    assert threshold(scale=0.5, mode="norm", max_norm=8.0) == 4.0  # after a rollback
    assert threshold(mode="inf", max_norm=3.0) == 3.0
    assert threshold(mode="autoclip", percentile=50.0) == 3.0
    for mode in ("value", "agc", "none"):
        assert threshold(mode=mode) is None


def test_suggested_threshold_clips_the_complementary_share():
    norms = np.random.default_rng(0).lognormal(1.0, 0.8, size=400)
    norms[[5, 17]] = np.nan  # non-finite steps are the guard's business, not the threshold's
    for p, threshold, share in grad_report.suggest(norms, [50, 75, 90, 95, 99]):
        finite = norms[np.isfinite(norms)]
        assert share == pytest.approx(np.mean(finite > threshold))
        assert share == pytest.approx((100 - p) / 100, abs=1.5 / len(finite))


def test_real_run_csv_report_and_tensorboard(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train(["trainer.max_steps=12", "trainer.eval_every=12", "stats.every=1"], run, cache_dir)
    rows = read_csv(run / CSV_NAME)
    glob = [r for r in rows if r["name"] == GLOBAL]
    assert [int(r["step"]) for r in glob] == list(range(12))
    assert all(math.isfinite(float(r["grad_norm"])) and r["threshold"] == "100.0" for r in glob)
    n_layers = len(rows) // 12 - 1
    assert n_layers > 20 and len(rows) == 12 * (n_layers + 1)

    loaded = grad_report.load_run(run)
    for p, _, share in grad_report.suggest(loaded.norm, [50, 75, 90]):
        assert share == pytest.approx((100 - p) / 100, abs=1 / 12 + 1e-9)
    assert grad_report.main([str(run)]) == 0
    assert (run / "grad_report.png").stat().st_size > 10_000
    md = (run / "grad_report.md").read_text()
    assert "Suggested thresholds for `clip=norm clip.max_norm`" in md and "| p90 |" in md
    assert "Layers that dominate the norm" in md and "parser." in md

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"), size_guidance={"images": 0, "histograms": 0})
    tb.Reload()
    tags = tb.Tags()
    assert "attention/0" in tags["images"] and "stats/grad_norm_clipped" in tags["scalars"]
    assert any(t.startswith("grad/parser.") for t in tags["histograms"])
    assert any(t.startswith("weight/watcher.") for t in tags["histograms"])


def test_injected_fault_is_written_and_reported(tmp_path, cache_dir):
    run = tmp_path / "fault"
    run_train(["trainer.max_steps=4", "fault=nan_input", "fault.step=2", "stats.every=100"], run, cache_dir)
    rows = read_csv(run / CSV_NAME)
    assert {int(r["step"]) for r in rows} == {0, 2}  # step 0 by stats.every, step 2 because it was anomalous
    step2 = {r["name"]: r for r in rows if r["step"] == "2"}
    assert step2[GLOBAL]["skipped"] == "1" and int(step2[GLOBAL]["nonfinite"]) > 0
    assert int(step2["watcher.blocks.0.0.0.weight"]["nonfinite"]) > 0  # the NaN pixel meets the first conv
    assert all(float(r["update_ratio"]) == 0.0 for r in step2.values())
    out = tmp_path / "report"
    assert grad_report.main([str(run), "--out", str(out)]) == 0
    md = (out / "grad_report.md").read_text()
    assert "Anomalous steps" in md and "| 2 | yes |" in md


def test_report_of_a_run_without_statistics_names_the_setting(tmp_path):
    with pytest.raises(UserError, match=r"grad_stats.csv does not exist; train with stats.every > 0"):
        grad_report.main([str(tmp_path)])
