"""masked_softmax: parity with torch.softmax, finiteness where the naive WAP formula dies, and its NaN at z0 = 92."""

import pytest
import torch

from wapstable.model.attention import CoverageAttention, masked_softmax


def ragged(B: int, L: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None] < lengths[:, None]  # (B, L) prefix masks of ragged lengths
    return torch.randn(B, L, generator=g) * 3, mask


def reference(energy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.softmax(energy.double().masked_fill(~mask.bool(), float("-inf")), -1)


@pytest.mark.parametrize("float_mask", [False, True])
def test_stable_equals_torch_softmax_over_valid_positions(float_mask):
    energy, mask = ragged(8, 23)
    mask[3] = torch.rand(23, generator=torch.Generator().manual_seed(1)) < 0.5  # a non-prefix mask too
    mask[3, 0] = True
    out = masked_softmax(energy, mask.float() if float_mask else mask)
    torch.testing.assert_close(out.double(), reference(energy, mask), atol=1e-6, rtol=0)
    assert (out[~mask] == 0).all()


def test_naive_matches_stable_for_ordinary_logits():
    # The naive formula is kept faithful: it is only wrong where it overflows.
    energy, mask = ragged(6, 17, seed=2)
    torch.testing.assert_close(masked_softmax(energy, mask, stable=False), masked_softmax(energy, mask))


def test_stable_finite_value_and_gradient_for_huge_logits():
    energy, mask = ragged(8, 31, seed=3)
    energy = (torch.sign(energy) * 1e4).requires_grad_()
    out = masked_softmax(energy, mask)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(energy.grad).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(8))
    assert (out[~mask] == 0).all()


def test_huge_logit_on_padding_stays_zero():
    # inf * 0 at a padded position was one of the naive formula's NaNs.
    energy = torch.zeros(2, 5)
    energy[:, 4] = 1e4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = masked_softmax(energy, mask)
    torch.testing.assert_close(out[0], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0, 0]))
    assert torch.isnan(masked_softmax(energy, mask, stable=False)[0]).all()


def test_fully_masked_row_gives_zeros_and_finite_gradient():
    energy = torch.randn(3, 7, requires_grad=True)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1] = False
    out = masked_softmax(energy, mask)
    out.backward(torch.randn_like(out) * 100)
    assert (out[1] == 0).all()
    assert torch.isfinite(energy.grad).all() and (energy.grad[1] == 0).all()
    assert torch.isnan(masked_softmax(energy.detach(), mask, stable=False)[1]).all()  # 0 / 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    energy, mask = ragged(4, 19, seed=4)
    out = masked_softmax(energy.to(dtype), mask)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(energy.to(dtype).float(), mask), atol=1e-2, rtol=0)
    big = (torch.sign(energy) * 1e4).to(dtype).requires_grad_()
    out = masked_softmax(big, mask)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(big.grad).all()
    # float16's exp overflows above about 11.1: the naive formula breaks long before float32's 88.7.
    if dtype == torch.float16:
        assert torch.isnan(
            masked_softmax(torch.full((1, 3), 12.0, dtype=dtype), torch.ones(1, 3), False)
        ).all()


@pytest.mark.parametrize("z0", [92.0, 1e4])
def test_naive_softmax_overflows_to_nan(z0):
    # The original failure: exp(z0) with z0 = 92 overflows float32 (limit about e^88.7), and inf / inf = NaN.
    energy = torch.tensor([[z0, 1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 3)
    naive = masked_softmax(energy, mask, stable=False)
    assert torch.isnan(naive).any()
    naive.sum().backward()
    assert not torch.isfinite(energy.grad).all()
    stable = masked_softmax(energy.detach(), mask)
    torch.testing.assert_close(stable, torch.tensor([[1.0, 0.0, 0.0]]))


def graph_ops(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def coverage_attention_inputs(B=3, h=4, w=6, C=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(B, h * w, C, generator=g)
    mask = torch.ones(B, h, w)
    mask[1, :, 4:] = 0
    mask[2, 2:] = 0
    return torch.randn(B, 16, generator=g), features, mask


def test_coverage_attention_shapes_and_mask():
    torch.manual_seed(0)
    att = CoverageAttention(query_dim=16, feat_dim=8, dim=12, coverage_channels=5, coverage_kernel=5)
    query, features, mask = coverage_attention_inputs()
    context, alpha = att(query, features, att.project_features(features), mask, torch.rand(3, 4, 6) * mask)
    assert context.shape == (3, 8) and alpha.shape == (3, 4, 6)
    torch.testing.assert_close(alpha.sum((1, 2)), torch.ones(3))
    assert (alpha[mask == 0] == 0).all()
    torch.testing.assert_close(context, torch.einsum("bl,blc->bc", alpha.flatten(1), features))
    # The stable form runs torch's fused softmax (max subtracted inside); the naive one keeps the original exp,
    # which the NaN localiser names under this module when it overflows.
    assert "SoftmaxBackward0" in graph_ops(alpha) and "ExpBackward0" not in graph_ops(alpha)
    att.stable = False
    _, naive = att(query, features, att.project_features(features), mask, torch.rand(3, 4, 6) * mask)
    assert "ExpBackward0" in graph_ops(naive)


def test_coverage_kernel_must_be_odd():
    with pytest.raises(ValueError, match="coverage_kernel"):
        CoverageAttention(16, 8, 12, 5, coverage_kernel=4)


@pytest.mark.parametrize("stable", [False, True])
def test_energy_scale_fault(stable):
    torch.manual_seed(0)
    att = CoverageAttention(16, 8, 12, 5, 3, stable=stable)
    att.energy_scale = 1e4
    query, features, mask = coverage_attention_inputs()
    context, alpha = att(query, features, att.project_features(features), mask, torch.zeros(3, 4, 6))
    assert torch.isfinite(alpha).all() == stable
