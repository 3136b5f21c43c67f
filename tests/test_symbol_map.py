"""The symbol map (model.symbol_map): each annotation cell classified as the symbol whose box covers it, from the
data's symbol boxes. Its targets, its loss, its place in the training loss (off it changes nothing), its head in
init_from, and a run through train.py that logs it."""

import csv
import logging
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, compose_config, vgg

from wapstable.config import AttentionConfig, ModelConfig
from wapstable.data.batches import Batch
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError
from wapstable.model.loss import forward_loss, sequence_loss, symbol_map_loss
from wapstable.model.wap import build_model
from wapstable.train.build import init_from, validate_config

NAN = [float("nan")] * 4
V = 12


def test_each_cell_is_the_symbol_that_covers_it():
    # token 3's box fills cell (0, 0); token 5's the right half of cell (1, 2); token 4 has no box
    regions = torch.tensor([[[0.0, 0.0, 16.0, 16.0], NAN, [40.0, 16.0, 48.0, 32.0]]])
    targets = torch.tensor([[3, 4, 5]])
    mask = torch.ones(1, 2, 3)
    right = torch.full((1, V, 2, 3), -20.0)
    right[:, 0] = 20.0  # background everywhere ...
    right[0, :, 0, 0] = -20.0
    right[0, 3, 0, 0] = 20.0  # ... but the first symbol in its cell
    right[0, 0, 1, 2] = right[0, 5, 1, 2] = 20.0  # half symbol 5, half background
    loss = symbol_map_loss(right, mask, regions, targets, stride=16)
    assert loss == pytest.approx(
        math.log(2), abs=1e-4
    )  # only the half-covered cell is uncertain, as it should be
    wrong = right.clone()
    wrong[0, 3, 0, 0], wrong[0, 4, 0, 0] = -20.0, 20.0  # the symbol without a box in the first one's cell
    assert symbol_map_loss(wrong, mask, regions, targets, stride=16) > 30
    everything_background = torch.full((1, V, 2, 3), -20.0)
    everything_background[:, 0] = 20.0
    assert symbol_map_loss(everything_background, mask, regions, targets, stride=16) > 40 + math.log(2)


def test_images_without_boxes_and_padded_cells_add_nothing():
    targets = torch.tensor([[3, 4], [6, 0]])
    logits = torch.randn(2, V, 2, 3, generator=torch.Generator().manual_seed(0))
    regions = torch.tensor([[[0.0, 0.0, 16.0, 16.0], NAN], [NAN, NAN]])
    mask = torch.ones(2, 2, 3)
    both = symbol_map_loss(logits, mask, regions, targets, 16)
    first = symbol_map_loss(logits[:1], mask[:1], regions[:1], targets[:1], 16)
    torch.testing.assert_close(both, first / 2)  # the second image has no boxes: it adds 0, the mean over 2
    mask[0, :, 2] = 0  # a padded column
    log_p = F.log_softmax(logits[:1], 1)
    torch.testing.assert_close(
        symbol_map_loss(logits, mask, regions, targets, 16),
        (-(log_p[0, 3, 0, 0]) - log_p[0, 0].sum() + log_p[0, 0, 0, 0] + log_p[0, 0, :, 2].sum()) / 2,
    )


def tiny_model(symbol_map=0.0, counting=0.0):
    torch.manual_seed(0)
    cfg = ModelConfig(
        watcher=vgg([4, 8, 8, 8], convs_per_block=1),
        embed_dim=8,
        hidden_dim=16,
        counting=counting,
        symbol_map=symbol_map,
        attention=AttentionConfig(dim=8, coverage_channels=4, coverage_kernel=3, position_features=8),
    )
    return build_model(cfg, V)


def tiny_batch():
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 1, 40, 70, generator=g)
    image_mask = torch.ones(2, 40, 70)
    image_mask[1, :, 50:] = 0
    targets = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]])
    target_mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    regions = torch.full((2, 4, 4), float("nan"))
    regions[0, 0], regions[0, 2], regions[1, 1] = (
        torch.tensor([2.0, 2, 14, 30]),
        torch.tensor([40.0, 10, 60, 20]),
        torch.tensor([20.0, 5, 30, 35]),
    )
    return Batch(images, image_mask, targets, target_mask, ["a", "b"], regions)


def test_off_builds_no_head_and_leaves_the_loss_bit_for_bit():
    batch = tiny_batch()
    off = tiny_model()
    assert off.symbol_head is None and not any("symbol_head" in k for k in off.state_dict())
    reference = sequence_loss(
        off(batch.images, batch.image_mask, batch.targets), batch.targets, batch.target_mask
    )
    assert torch.equal(forward_loss(off, batch), reference)
    assert off.symbol_map_value is None
    on = tiny_model(0.5)
    on.load_state_dict(off.state_dict(), strict=False)  # the same watcher and parser, plus the head
    assert torch.equal(forward_loss(on, batch._replace(regions=None)), reference)  # data without boxes
    assert on.symbol_map_value is None
    loss = forward_loss(on, batch)
    assert on.symbol_map_value is not None and on.symbol_map_value > 0
    torch.testing.assert_close(loss, reference + 0.5 * on.symbol_map_value)
    assert {"symbol_head.weight", "symbol_head.bias"} <= set(on.output_layer_names())


def test_the_symbol_map_trains_the_watcher_and_is_learnt():
    model, batch = tiny_model(1.0, counting=1.0), tiny_batch()
    forward_loss(model, batch).backward()
    assert model.symbol_head.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.watcher.parameters())
    model.zero_grad()
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    values = []
    for _ in range(30):
        opt.zero_grad()
        forward_loss(model, batch).backward()
        values.append(float(model.symbol_map_value))
        opt.step()
    assert values[-1] < 0.3 * values[0], values


def test_init_from_matches_the_heads_rows_by_token(tmp_path):
    from wapstable.checkpoint import save_checkpoint

    src_vocab = Vocab(["<eol>", *(f"t{i}" for i in range(1, V))])  # <eol> first, then t1 .. t11
    src = tiny_model(1.0)
    save_checkpoint({"model": src.state_dict(), "vocab": list(src_vocab.tokens)}, tmp_path / "src.pt")
    dst_vocab = Vocab(["<eol>", *(f"t{i}" for i in range(11, 0, -1))])  # the same tokens in reverse order
    dst = tiny_model(1.0)
    init_from(dst, tmp_path / "src.pt", dst_vocab)
    row = dst_vocab.tokens.index("t3")
    assert torch.equal(dst.symbol_head.weight[row], src.symbol_head.weight[src_vocab.tokens.index("t3")])
    assert torch.equal(dst.symbol_head.weight[0], src.symbol_head.weight[0])  # background, the <eol> row


def test_a_run_with_the_symbol_map_logs_it(tmp_path, cache_dir, caplog):
    from wapstable.train.stages import train

    args = [*TINY, "trainer.max_steps=4", "trainer.eval_every=4", "trainer.checkpoint_every=4", "logger=csv",
            f"data.cache_dir={cache_dir}", "model.symbol_map=1.0"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="wapstable"):
        metrics = train(compose_config(args, run_dir=tmp_path / "run"))
    assert metrics["steps"] == 4
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    values = [float(r["train/symbol_map"]) for r in rows if r["train/symbol_map"]]
    assert len(values) == 4 and all(math.isfinite(v) and v > 0 for v in values)
    evals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert evals and all("symbol map" in m for m in evals)  # each evaluation's line says it


def test_the_map_off_turns_the_readout_off_quietly(caplog):
    cfg = compose_config(["model.symbol_map=0"])
    assert cfg.model.symbol_readout  # the default model's, left as it is
    with caplog.at_level(logging.WARNING, logger="wapstable"):
        validate_config(cfg)
    assert not caplog.records  # `model.symbol_map=0` is how the docs turn the map off: nothing to warn about
    model = build_model(cfg.model, 20)
    assert model.symbol_head is None and not model.symbol_readout


def test_a_negative_weight_is_refused_and_data_without_boxes_is_told(caplog):
    with pytest.raises(UserError, match=r"model\.symbol_map"):
        validate_config(compose_config(["model.symbol_map=-1"]))
    with caplog.at_level(logging.WARNING, logger="wapstable"):
        validate_config(compose_config(["data=wap_pkl", "model.symbol_map=1"]))
    assert any(
        "model.symbol_map=1" in r.getMessage() and "data=wap_pkl" in r.getMessage() for r in caplog.records
    )


def test_the_symbol_map_under_bf16_and_ddp(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, batch = tiny_model(1.0), tiny_batch()
    assert torch.isfinite(forward_loss(model, batch, precision="bf16"))
    assert torch.isfinite(model.symbol_map_value) and model.symbol_map_value > 0
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(model)
        loss = forward_loss(wrapped, batch)  # through DDP's forward, so its reducer sees the head
        loss.backward()
        torch.testing.assert_close(loss, forward_loss(model, batch))
        assert model.symbol_map_value is not None
        assert model.symbol_head.weight.grad is not None and model.symbol_head.weight.grad.abs().sum() > 0
    finally:
        dist.destroy_process_group()


def test_a_skipped_step_skips_the_symbol_map(monkeypatch):
    from wapstable.model import loss as loss_module
    from wapstable.stability.step_guard import Outcome, StepGuard

    model, batch = tiny_model(1.0), tiny_batch()
    guard = StepGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), clip="norm", max_norm=10.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(loss_module, "symbol_map_loss", lambda *a, **k: torch.tensor(float("nan")))
    result = guard.step(forward_loss(model, batch))
    assert result.outcome is Outcome.NONFINITE  # the map is inside the guarded loss
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    monkeypatch.undo()
    assert guard.step(forward_loss(model, batch)).outcome is Outcome.ACCEPTED
    assert not torch.equal(before["symbol_head.weight"], model.symbol_head.weight)


@pytest.mark.slow  # make test-all (make test stays under 5 minutes)
def test_the_finer_grid_readout_and_smoothing_run_end_to_end_through_train_py(tmp_path, cache_dir):
    import json

    from conftest import ROOT, python_run, run_train
    from test_evaluate import LEARN, assert_reads, write_read_set

    from wapstable.checkpoint import load_checkpoint
    from wapstable.eval.evaluation import load_model

    run = tmp_path / "run"
    opts = [
        "model.watcher.pool_last=false",
        "model.symbol_map=1",
        "model.symbol_readout=true",
        "model.label_smoothing=0.1",
    ]
    # a data set the model learns by heart in LEARN's 60 steps: the figures compared below are not 0 == 0
    data = write_read_set(tmp_path / "wap")
    run_train([*opts, *data, *LEARN, "logger=csv"], run, cache_dir)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 60
    assert_reads({"exprate": metrics["test_exprate"], "wer": metrics["test_wer"]})
    ckpt = run / "checkpoints" / "best.pt"
    model, _, _ = load_model(
        ckpt
    )  # the checkpoint's own config rebuilds the same model, its last pool left out
    assert model.watcher.stride == 8 and model.symbol_readout and model.label_smoothing == 0.1
    assert model.watcher.stride == 2 ** (
        len(load_checkpoint(ckpt)["config"]["model"]["watcher"]["channels"]) - 1
    )
    # evaluate.py decodes with the readout, as the run's final test did: the same figures
    proc = python_run(
        [sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(ckpt), "trainer.device=cpu"]
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((ckpt.parent / "eval-test.json").read_text())
    assert result["exprate"] == pytest.approx(metrics["test_exprate"])
    assert result["within_1"] == pytest.approx(metrics["test_within_1"])
    assert result["wer"] == pytest.approx(metrics["test_wer"])


@pytest.mark.parametrize(
    "args, key",
    [
        (["model.label_smoothing=1.0"], "model.label_smoothing"),
        (["model.label_smoothing=-0.1"], "model.label_smoothing"),
    ],
)
def test_bad_smoothing_is_one_sentence_and_writes_nothing(tmp_path, cache_dir, args, key):
    from conftest import run_train

    proc = run_train(args, tmp_path / "run", cache_dir, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and key in out and "Traceback" not in out
    assert not (tmp_path / "run" / "checkpoints").exists()
