"""WAP model: shapes for both watchers, padding invariance, paper sizes, step/forward parity, the overflow fault."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DENSE, vgg

from wapstable.config import AttentionConfig, ModelConfig
from wapstable.errors import UserError
from wapstable.model.attention import CoverageAttention, grid_positions
from wapstable.model.decoding import beam_search, greedy_decode
from wapstable.model.wap import build_model

V = 11


TINY_WATCHERS = {
    "vgg": vgg([4, 8], convs_per_block=2),
    "dense": {"_target_": DENSE, "init_channels": 8, "growth": 4, "layers": 2, "blocks": 2},
}


def tiny_cfg(watcher: str, **kw) -> ModelConfig:
    """A tiny model of `watcher` (vgg, dense, or any _target_); `kw`: the watcher's options or the model's keys."""
    cfg = ModelConfig(
        watcher=dict(TINY_WATCHERS.get(watcher, {"_target_": watcher})),
        embed_dim=12,
        hidden_dim=16,
        attention=AttentionConfig(dim=10, coverage_channels=3, coverage_kernel=3),
    )
    for k, v in kw.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
        else:
            cfg.watcher[k] = v
    return cfg


def randomise_batchnorm(model: torch.nn.Module, seed: int = 0) -> None:
    # Fresh BN stats (mean 0, var 1, affine 1/0) map padded zeros to zero anyway: perturb them so that the padding
    # test would catch a BN shift leaking into the padding.
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g))
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))


def pad_batch(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad (H, W) images into (B, 1, H, W) and their (B, H, W) masks."""
    H = max(im.shape[0] for im in images)
    W = max(im.shape[1] for im in images)
    x, mask = torch.zeros(len(images), 1, H, W), torch.zeros(len(images), H, W)
    for i, im in enumerate(images):
        x[i, 0, : im.shape[0], : im.shape[1]] = im
        mask[i, : im.shape[0], : im.shape[1]] = 1
    return x, mask


def ceil_halve(n: int, times: int) -> int:
    for _ in range(times):
        n = math.ceil(n / 2)
    return n


def targets(B: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(1, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    tmask = (torch.arange(T)[None] < lengths[:, None]).float()
    y[torch.arange(B), lengths - 1] = 0  # <eol>
    return y * tmask.long(), tmask


@pytest.mark.parametrize("watcher", ["vgg", "dense"])
def test_shapes_with_ragged_odd_sizes(watcher):
    torch.manual_seed(0)
    model = build_model(tiny_cfg(watcher), V)
    sizes = [(13, 37), (21, 19), (8, 50)]
    x, mask = pad_batch([torch.rand(h, w) for h, w in sizes])
    features, feat_mask = model.encode(x, mask)
    s = model.watcher.stride
    assert s == {"vgg": 4, "dense": 8}[watcher] and features.shape[1] == model.watcher.out_channels
    assert features.shape[-2:] == feat_mask.shape[-2:] == (math.ceil(21 / s), math.ceil(50 / s))
    for i, (h, w) in enumerate(sizes):
        n = s.bit_length() - 1
        assert feat_mask[i].sum() == ceil_halve(h, n) * ceil_halve(w, n)  # each image's own ceil chain
    assert (features.permute(1, 0, 2, 3)[:, feat_mask == 0] == 0).all()
    y, tmask = targets(3, 6)
    logits = model(x, mask, y, tmask)
    assert logits.shape == (3, 6, V) and torch.isfinite(logits).all()


@pytest.mark.parametrize("watcher", ["vgg", "dense"])
@pytest.mark.parametrize("size", [(13, 29), (16, 32), (9, 19)])
@pytest.mark.parametrize("positions", [0, 8])
def test_padding_does_not_change_the_output(watcher, size, positions):
    torch.manual_seed(0)
    cfg = tiny_cfg(watcher)
    cfg.attention.position_features = (
        positions  # positions count from the top-left cell, as padding leaves it
    )
    model = build_model(cfg, V)
    randomise_batchnorm(model)
    model.eval()
    small, big = torch.rand(*size), torch.rand(23, 47)
    y, tmask = targets(2, 7)
    with torch.no_grad():
        alone = model(*pad_batch([small]), y[:1], tmask[:1])
        batched = model(*pad_batch([small, big]), y, tmask)
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", [0, 8])
@pytest.mark.parametrize("readout", [False, True])
def test_step_reproduces_teacher_forcing(positions, readout):
    # Greedy decoding must see the same math the model was trained with: step() runs the readout per token,
    # teacher forcing runs it once over all tokens after the recurrence; the symbol readout likewise.
    torch.manual_seed(0)
    cfg = tiny_cfg("vgg", symbol_map=1.0 if readout else 0.0, symbol_readout=readout)
    cfg.attention.position_features = positions
    model = build_model(cfg, V)
    randomise_batchnorm(model)  # a symbol head whose map is not flat, so that the readout adds something
    model.eval()
    x, mask = pad_batch([torch.rand(17, 30), torch.rand(12, 41)])
    y, tmask = targets(2, 5)
    with torch.no_grad():
        logits = model(x, mask, y, tmask)
        state = model.init_state(*model.encode(x, mask))
        prev = torch.full((2,), model.start_index)
        for t in range(5):
            log_probs, state, alpha = model.step(state, prev)
            torch.testing.assert_close(log_probs, F.log_softmax(logits[:, t], -1))
            assert alpha.shape == state.coverage.shape
            prev = y[:, t]
    torch.testing.assert_close(state.coverage.sum((1, 2)), torch.full((2,), 5.0))
    assert (state.symbols is not None) == readout


def test_symbol_readout_adds_the_attended_symbol_map_to_the_logits():
    torch.manual_seed(0)
    on = build_model(tiny_cfg("vgg", symbol_map=1.0, symbol_readout=True), V)
    off = build_model(tiny_cfg("vgg", symbol_map=1.0), V)
    off.load_state_dict(on.state_dict())
    randomise_batchnorm(on)
    off.load_state_dict(on.state_dict())
    on.eval(), off.eval()
    x, mask = pad_batch([torch.rand(17, 30), torch.rand(12, 41)])
    y, tmask = targets(2, 5)
    with torch.no_grad():
        plain, alphas = off(x, mask, y, tmask, with_alphas=True)[::2]
        read = on(x, mask, y, tmask)
        features, _ = on.encode(x, mask)
        maps = F.log_softmax(on.symbol_head(features), 1)  # (B, V, h, w)
        by_hand = (alphas.unsqueeze(2) * maps.unsqueeze(1)).sum((-2, -1))  # (B, T, V)
    by_hand[..., 0] = 0  # the background row says nothing about <eol>
    torch.testing.assert_close(read, plain + by_hand, atol=1e-5, rtol=1e-5)
    assert by_hand.abs().amax() > 0.1
    beams = [beam_search(on, x, mask, k, 6) for k in (1, 3)]
    assert beams[0] == greedy_decode(on, x, mask, 6)  # the readout in both decoders, through select_state
    no_map = build_model(tiny_cfg("vgg", symbol_readout=True), V)  # without the map there is nothing to read
    assert not no_map.symbol_readout and no_map.init_state(*no_map.encode(x, mask)).symbols is None


def test_select_state():
    torch.manual_seed(0)
    model = build_model(tiny_cfg("vgg"), V)
    state = model.init_state(*model.encode(*pad_batch([torch.rand(9, 9), torch.rand(20, 20)])))
    picked = model.select_state(state, torch.tensor([1, 1, 0]))
    assert picked.h.shape[0] == picked.features.shape[0] == 3
    torch.testing.assert_close(picked.features[0], state.features[1])
    kept = model.select_state(state, torch.tensor([1, 0]), memory=False)
    assert kept.features is state.features and torch.equal(kept.h, state.h.flip(0))


def test_names_the_trainer_relies_on():
    model = build_model(tiny_cfg("vgg"), V)
    assert isinstance(dict(model.named_modules())["parser.attention"], CoverageAttention)
    params = dict(model.named_parameters())
    assert model.output_layer_names() == ["parser.out.weight", "parser.out.bias"]
    assert params["parser.out.weight"].shape[0] == V
    assert model.parser.embed.num_embeddings == V + 1 and model.start_index == V


def test_paper_sizes():
    # WAP (Zhang et al. 2017): 4 blocks x 4 conv3x3, [32, 64, 64, 128], stride 16.
    wap = build_model(ModelConfig(watcher=vgg([32, 64, 64, 128], convs_per_block=4)), 111)
    assert (wap.watcher.out_channels, wap.watcher.stride) == (128, 16)
    # DenseWAP (Zhang et al. 2018): 48 ch stem, 3 blocks x 16 layers, growth 24, compression 0.5 -> 684, stride 16.
    watcher = {"_target_": DENSE, "init_channels": 48, "growth": 24, "layers": 16, "blocks": 3}
    cfg = ModelConfig(watcher={**watcher, "compression": 0.5, "dropout": 0.2}, dropout=0.2)
    dense = build_model(cfg, 111).eval()
    assert (dense.watcher.out_channels, dense.watcher.stride) == (684, 16)
    with torch.no_grad():
        features, feat_mask = dense.encode(torch.rand(1, 1, 33, 40), torch.ones(1, 33, 40))
    assert features.shape == (1, 684, 3, 3) and feat_mask.shape == (1, 3, 3)


def test_block_convs_set_each_blocks_depth():
    model = build_model(tiny_cfg("vgg", block_convs=[1, 3]), V)
    assert [len(block) for block in model.watcher.blocks] == [1, 3] and model.watcher.stride == 4
    assert [len(block) for block in build_model(tiny_cfg("vgg"), V).watcher.blocks] == [2, 2]


@pytest.mark.parametrize("size", [(13, 29), (16, 32)])
def test_pool_last_false_halves_the_stride_and_keeps_padding_invisible(size):
    torch.manual_seed(0)
    fine, coarse = build_model(tiny_cfg("vgg", pool_last=False), V), build_model(tiny_cfg("vgg"), V)
    assert (fine.watcher.stride, coarse.watcher.stride) == (2, 4)
    coarse.load_state_dict(fine.state_dict())  # the same weights: only the last pool differs
    x, mask = pad_batch([torch.rand(*size)])
    f_fine, m_fine = fine.encode(x, mask)
    f_coarse, _ = coarse.encode(x, mask)
    assert f_fine.shape[-2:] == (math.ceil(size[0] / 2), math.ceil(size[1] / 2))
    torch.testing.assert_close(F.max_pool2d(f_fine, 2, ceil_mode=True), f_coarse)  # the pool it leaves out
    randomise_batchnorm(fine)
    fine.eval()
    y, tmask = targets(2, 5)
    with torch.no_grad():
        alone = fine(x, mask, y[:1], tmask[:1])
        batched = fine(*pad_batch([torch.rand(*size), torch.rand(23, 47)]), y, tmask)
        again = fine(*pad_batch([x[0, 0, : size[0], : size[1]], torch.rand(23, 47)]), y, tmask)
    assert batched.shape == (2, 5, V)
    torch.testing.assert_close(again[:1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [(13, 29), (16, 32), (3, 5)])
@pytest.mark.parametrize("block_convs", [[1, 2], [2, 1]])
def test_first_stride_2_strides_the_first_conv_and_keeps_padding_invisible(size, block_convs):
    torch.manual_seed(0)
    strided = build_model(tiny_cfg("vgg", first_stride=2, block_convs=block_convs), V)
    pooled = build_model(tiny_cfg("vgg", block_convs=block_convs), V)
    assert strided.watcher.stride == pooled.watcher.stride == 4
    assert strided.watcher.blocks[0][0][0].stride == (2, 2)
    assert pooled.watcher.blocks[0][0][0].stride == (1, 1)
    assert sum(p.numel() for p in strided.parameters()) == sum(p.numel() for p in pooled.parameters())
    x, mask = pad_batch([torch.rand(*size)])
    features, _ = strided.encode(x, mask)
    assert (
        features.shape[-2:]
        == pooled.encode(x, mask)[0].shape[-2:]
        == (math.ceil(size[0] / 4), math.ceil(size[1] / 4))
    )
    randomise_batchnorm(strided)
    strided.eval()
    y, tmask = targets(2, 5)
    with torch.no_grad():
        alone = strided(x, mask, y[:1], tmask[:1])
        batched = strided(*pad_batch([x[0, 0, : size[0], : size[1]], torch.rand(23, 47)]), y, tmask)
        wide = strided(
            *pad_batch([torch.rand(23, 47), x[0, 0, : size[0], : size[1]]]), y.flip(0), tmask.flip(0)
        )
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wide[1:], alone, atol=1e-5, rtol=1e-5)
    assert not torch.equal(batched[1:], batched[:1])  # the other image reads otherwise: the check can fail
    # One block only: the strided conv is its pool; pool_last says nothing more.
    for pool_last in (True, False):
        one = build_model(
            tiny_cfg("vgg", channels=[4], block_convs=[], first_stride=2, pool_last=pool_last), V
        )
        assert one.watcher.stride == 2


def test_bad_config_names_the_key():
    with pytest.raises(UserError, match="model.watcher.block_convs"):
        build_model(tiny_cfg("vgg", block_convs=[1, 2, 3]), V)
    with pytest.raises(UserError, match="model.watcher.first_stride=3 must be 1"):
        build_model(tiny_cfg("vgg", first_stride=3), V)
    with pytest.raises(UserError, match="model.watcher._target_=resnet is not an importable class"):
        build_model(tiny_cfg("resnet"), V)
    with pytest.raises(UserError, match="model.watcher.growht"):
        build_model(tiny_cfg("dense", growht=3), V)
    with pytest.raises(UserError, match="model.watcher.channels"):
        build_model(tiny_cfg("vgg", channels="wide"), V)
    with pytest.raises(UserError, match="does not declare its out_channels and stride"):
        build_model(tiny_cfg("torch.nn.Identity"), V)
    with pytest.raises(ValueError, match="model.embed_dim"):
        build_model(tiny_cfg("vgg", embed_dim=13), V)
    for smoothing in (-0.1, 1.0):
        with pytest.raises(UserError, match="model.label_smoothing"):
            build_model(tiny_cfg("vgg", label_smoothing=smoothing), V)


@pytest.mark.parametrize("stable", [False, True])
def test_attention_overflow_fault_end_to_end(stable):
    # The attention overflow through the whole model: energies x 1e4 overflow the naive exp; the stable softmax stays finite.
    torch.manual_seed(0)
    cfg = tiny_cfg("vgg")
    cfg.attention.stable = stable
    model = build_model(cfg, V)
    model.parser.attention.energy_scale = 1e4
    x, mask = pad_batch([torch.rand(16, 40), torch.rand(13, 25)])
    y, tmask = targets(2, 6)
    logits = model(x, mask, y, tmask)
    loss = (F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") * tmask.flatten()).sum()
    loss.backward()
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert finite == stable


def test_grid_positions_tell_every_cell_apart():
    pos = grid_positions(5, 40, 32)  # (h*w, C): 5 rows, 40 columns, as a wide expression at stride 16
    assert pos.shape == (200, 32) and torch.isfinite(pos).all() and pos.abs().max() <= 1
    assert torch.cdist(pos, pos).add(torch.eye(200) * 9).min() > 0.05  # no two cells share a code
    # the row half depends on the row only, the column half on the column only
    grid = pos.view(5, 40, 32)
    assert torch.equal(grid[:, :1, :16].expand(5, 40, 16), grid[..., :16])
    assert torch.equal(grid[:1, :, 16:].expand(5, 40, 16), grid[..., 16:])
    with pytest.raises(ValueError, match="position_features"):
        build_model(tiny_cfg("vgg", attention=AttentionConfig(dim=10, position_features=6)), V)


def test_position_features_reach_the_attention():
    # With positions on, two identical columns of features get different attention energies.
    torch.manual_seed(0)
    att = CoverageAttention(8, 4, 6, 3, 3, position_features=8)
    features = torch.ones(1, 6, 4)  # (B, L, C): every cell holds the same annotation
    mask, coverage = torch.ones(1, 2, 3), torch.zeros(1, 2, 3)
    _, alpha = att(torch.rand(1, 8), features, att.project_features(features, (2, 3)), mask, coverage)
    assert alpha.flatten().std() > 1e-4
    with pytest.raises(ValueError, match="grid"):
        att.project_features(features)


def test_counting_head_counts_symbols_and_trains_the_watcher():
    from wapstable.data.batches import Batch
    from wapstable.model.loss import counting_loss, forward_loss

    torch.manual_seed(0)
    y = torch.tensor([[3, 3, 5, 0, 0], [4, 0, 0, 0, 0]])
    tmask = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    truth = torch.zeros(2, V)
    truth[0, 3], truth[0, 5], truth[1, 4] = 2, 1, 1
    assert counting_loss(truth.clone(), y, tmask) == 0  # <eol> and padding are not counted
    assert counting_loss(truth + 0.5, y, tmask) > 0

    model = build_model(tiny_cfg("vgg", counting=0.5), V)
    plain = build_model(tiny_cfg("vgg"), V)
    assert plain.counter is None and "counter.weight" in model.output_layer_names()
    x, mask = pad_batch([torch.rand(17, 30), torch.rand(12, 41)])
    logits, counts = model(x, mask, y, tmask, with_counts=True)
    assert counts.shape == (2, V) and (counts >= 0).all()
    torch.testing.assert_close(logits, model(x, mask, y, tmask))  # decoding never sees the head
    batch = Batch(x, mask, y, tmask, ["a", "b"])
    loss = forward_loss(model, batch)
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    expected = (expected.view_as(tmask) * tmask).sum() / 2 + 0.5 * counting_loss(counts, y, tmask)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert model.counter.weight.grad.abs().sum() > 0
    assert model.watcher.blocks[0][0][0].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="model.counting"):
        build_model(tiny_cfg("vgg", counting=-1.0), V)


def test_label_smoothing_is_the_smoothed_cross_entropy_of_the_training_loss_only():
    from wapstable.data.batches import Batch
    from wapstable.model.loss import forward_loss, sequence_loss

    torch.manual_seed(0)
    x, mask = pad_batch([torch.rand(13, 29), torch.rand(9, 40)])
    y, tmask = targets(2, 6)
    batch = Batch(x, mask, y, tmask, ["a", "b"])
    plain, smoothed = build_model(tiny_cfg("vgg"), V), build_model(tiny_cfg("vgg", label_smoothing=0.2), V)
    smoothed.load_state_dict(plain.state_dict())
    assert (plain.label_smoothing, smoothed.label_smoothing) == (0.0, 0.2)
    logits = plain(x, mask, y, tmask)
    logp = F.log_softmax(logits, -1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    by_hand = ((0.8 * nll - 0.2 * logp.mean(-1)) * tmask).sum() / 2
    torch.testing.assert_close(forward_loss(smoothed, batch), by_hand)
    torch.testing.assert_close(forward_loss(plain, batch), sequence_loss(logits, y, tmask))
    assert not torch.allclose(by_hand, forward_loss(plain, batch))


def test_first_stride_through_train_py(tmp_path, cache_dir):
    """model.watcher.first_stride=2 reaches the watcher a run trains and the checkpoint it writes (a wrong value is
    refused by the watcher itself: test_bad_config_names_the_key)."""
    from conftest import run_train

    from wapstable.checkpoint import load_checkpoint
    from wapstable.eval.evaluation import load_model

    run = tmp_path / "run"
    run_train(["model.watcher.first_stride=2"], run, cache_dir)
    assert load_checkpoint(run / "checkpoints" / "last.pt")["config"]["model"]["watcher"]["first_stride"] == 2
    watcher = load_model(run / "checkpoints" / "last.pt")[0].watcher
    assert watcher.blocks[0][0][0].stride == (2, 2) and not watcher.pools[0]
