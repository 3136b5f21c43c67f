"""data.warp: each training image warped afresh at every step inside its own extent, its boxes moved with it."""

import pytest
import torch
from conftest import TINY, compose_config

from wapstable.data.batches import Batch
from wapstable.data.warp import warp_batch
from wapstable.errors import UserError
from wapstable.train.build import validate_config


def rect_batch():
    """Two images with one filled rectangle each (the second image narrower, padded), its box, and a NaN row."""
    images = torch.zeros(2, 1, 40, 90)
    mask = torch.zeros(2, 40, 90)
    mask[0, :40, :90] = 1
    mask[1, :32, :60] = 1
    images[0, 0, 10:30, 20:50] = 1.0
    images[1, 0, 8:20, 30:44] = 1.0
    regions = torch.tensor(
        [[[20.0, 10, 50, 30], [float("nan")] * 4], [[30.0, 8, 44, 20], [float("nan")] * 4]]
    )
    targets = torch.tensor([[3, 0], [4, 0]])
    return Batch(images, mask, targets, torch.ones(2, 2), ["a", "b"], regions)


def test_strength_0_is_the_batch_itself_and_draws_nothing():
    batch = rect_batch()
    state = torch.get_rng_state()
    assert warp_batch(batch, 0.0) is batch
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("seed", range(5))
def test_the_ink_moves_and_its_box_moves_with_it(seed):
    batch = rect_batch()
    out = warp_batch(batch, 2.0, torch.Generator().manual_seed(seed))
    assert not torch.equal(out.images, batch.images)
    assert (out.images[:, 0] * (1 - batch.image_mask)).abs().max() == 0  # the padding stays zeros
    assert torch.equal(out.image_mask, batch.image_mask) and torch.equal(out.targets, batch.targets)
    assert torch.isnan(out.regions[:, 1]).all()  # a token without a box keeps none
    for i in range(2):
        ink = out.images[i, 0] > 0.5
        ys, xs = torch.nonzero(ink, as_tuple=True)
        x0, y0, x1, y1 = out.regions[i, 0].tolist()
        # every inked pixel centre lies in the moved box (1 px for the bilinear edge) ...
        assert xs.min() + 0.5 >= x0 - 1 and xs.max() + 0.5 <= x1 + 1
        assert ys.min() + 0.5 >= y0 - 1 and ys.max() + 0.5 <= y1 + 1
        # ... and the box is not much larger than the ink
        assert (x1 - x0) <= (xs.max() - xs.min() + 1) * 1.3 + 2 and (y1 - y0) <= (
            ys.max() - ys.min() + 1
        ) * 1.3 + 2
        assert (
            ink.sum() > 0.4 * (batch.images[i, 0] > 0.5).sum()
        )  # strength 2 shrinks each axis to 70 % at most


def test_same_generator_same_warp():
    a = warp_batch(rect_batch(), 1.0, torch.Generator().manual_seed(7))
    b = warp_batch(rect_batch(), 1.0, torch.Generator().manual_seed(7))
    c = warp_batch(rect_batch(), 1.0, torch.Generator().manual_seed(8))
    assert torch.equal(a.images, b.images)
    assert not torch.equal(a.images, c.images)


def test_a_run_warps_its_batches_and_resumes_exactly(tmp_path, cache_dir):
    from wapstable.train.stages import train

    base = [*TINY, f"data.cache_dir={cache_dir}", "trainer.eval_every=4", "trainer.checkpoint_every=4"]
    plain = train(compose_config([*base, "trainer.max_steps=8"], run_dir=tmp_path / "plain"))
    warped = train(compose_config([*base, "trainer.max_steps=8", "data.warp=1"], run_dir=tmp_path / "warped"))
    assert warped["steps"] == 8
    assert warped["evals"][-1]["loss"] != plain["evals"][-1]["loss"]  # the warp changed what was learnt
    train(compose_config([*base, "trainer.max_steps=4", "data.warp=1"], run_dir=tmp_path / "resumed"))
    resumed = train(
        compose_config(
            [*base, "trainer.max_steps=8", "data.warp=1", "resume=auto"], run_dir=tmp_path / "resumed"
        )
    )
    assert (
        resumed["evals"][-1]["loss"] == warped["evals"][-1]["loss"]
    )  # the warps continue where they stopped


def test_a_negative_strength_is_refused():
    with pytest.raises(UserError, match=r"data\.warp"):
        validate_config(compose_config(["data.warp=-1"]))
