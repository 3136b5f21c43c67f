"""clip_gradients equals torch's clip_grad_norm_/clip_grad_value_ and implements AGC and AutoClip; every rule of
conf/clip/ builds from its `_target_`, refuses its bad values, backs off sharing its state, and old checkpoints'
`clip.mode` maps onto it."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from wapstable.config import CONF_DIR
from wapstable.errors import UserError
from wapstable.stability import AutoClipHistory, clip_gradients
from wapstable.stability.clip import build_clip, builtin_rules, legacy_clip, plan_clip

CLIP_OPTIONS = sorted(p.stem for p in (CONF_DIR / "clip").glob("*.yaml"))


def option(name: str, **changes) -> dict:
    """conf/clip/NAME.yaml as a dict, with `changes` on top."""
    return {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "clip" / f"{name}.yaml")), **changes}


def random_params(seed=0, scale=10.0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in [(7, 5), (5,), (3, 4, 3, 3)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


def clone(params):
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(out, params):
        p.grad = q.grad.clone()
    return out


@pytest.mark.parametrize("norm_type,max_norm", [(2.0, 5.0), (1.0, 5.0), (2.0, 1e6), (float("inf"), 2.0)])
def test_norm_modes_equal_torch(norm_type, max_norm):
    a = random_params()
    b = clone(a)
    mode = "inf" if norm_type == float("inf") else "norm"
    ours = clip_gradients(a, mode, max_norm=max_norm, norm_type=norm_type)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm, norm_type=norm_type)
    assert torch.equal(ours, ref)
    for p, q in zip(a, b):
        assert torch.equal(p.grad, q.grad)


def test_value_mode_equals_torch():
    a = random_params()
    b = clone(a)
    ours = clip_gradients(a, "value", value=3.0)
    torch.nn.utils.clip_grad_value_(b, 3.0)
    assert torch.equal(ours, torch.nn.utils.get_total_norm([p.grad for p in clone(random_params())]))
    for p, q in zip(a, b):
        assert torch.equal(p.grad, q.grad)
    assert max(float(p.grad.abs().max()) for p in a) <= 3.0


def test_gradient_explosion_linear_net_inf_norm():
    """The gradient-explosion worked example: Linear(5,5) of ones, L1 loss, then inf-norm clipping to 2."""

    def run(clip):
        net = torch.nn.Linear(5, 5)
        torch.nn.init.ones_(net.weight)
        torch.nn.init.zeros_(net.bias)
        x = torch.tensor([120.0, 200, 0.5, -200, 1])
        y = torch.tensor([2.0, 1, 5, 10, 40])
        torch.nn.functional.l1_loss(net(x), y).backward()
        return clip(net), net.weight.grad

    ours, g1 = run(lambda net: clip_gradients([net.weight], "inf", max_norm=2))
    ref, g2 = run(lambda net: torch.nn.utils.clip_grad_norm_(net.weight, max_norm=2, norm_type="inf"))
    assert torch.equal(ours, ref) and float(ours) == pytest.approx(40.0)
    assert torch.equal(g1, g2)
    assert float(g1.abs().max()) == pytest.approx(2.0, rel=1e-5)
    assert torch.allclose(g1[0], torch.tensor([1.2, 2.0, 0.005, -2.0, 0.01]), rtol=1e-4)


def test_agc_rescales_units_over_the_ratio_and_skips_excluded():
    w = torch.nn.Parameter(torch.ones(3, 4))  # unit norm 2 per row
    w.grad = torch.tensor([[0.001] * 4, [10.0] * 4, [0.0] * 4])
    out = torch.nn.Parameter(torch.ones(2, 2))
    out.grad = torch.full((2, 2), 100.0)
    clip_gradients([w, out], "agc", factor=0.01, eps=1e-3, skip=[out])
    assert torch.equal(w.grad[0], torch.full((4,), 0.001))  # ratio 0.001 < 0.01: untouched
    assert float(w.grad[1].norm()) == pytest.approx(0.01 * 2.0, rel=1e-4)  # clipped to factor * |W|
    assert torch.equal(out.grad, torch.full((2, 2), 100.0))  # the output layer is excluded


def test_autoclip_uses_percentile_of_history():
    history = AutoClipHistory(100)
    norms = []
    for seed in range(20):
        params = random_params(seed, scale=float(seed + 1))
        before = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(float(before))
        returned = clip_gradients(params, "autoclip", percentile=25, history=history)
        assert torch.equal(returned, before)
        after = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        assert after <= np.percentile(norms, 25) * (1 + 1e-5)
    state = history.state_dict()
    restored = AutoClipHistory(1)
    restored.load_state_dict(state)
    assert restored.count == 20 and float(restored.percentile(25)) == pytest.approx(
        np.percentile(norms, 25), rel=1e-5
    )


def test_nonfinite_norm_is_reported():
    params = random_params()
    params[0].grad[0, 0] = float("nan")
    assert not torch.isfinite(clip_gradients(params, "norm", max_norm=1.0))


@pytest.mark.parametrize("name", CLIP_OPTIONS)
def test_every_option_builds_its_rule(name):
    rule = build_clip(option(name))
    assert rule.name == name and builtin_rules()[name] is type(rule)
    params = random_params()
    total, plan = plan_clip(params, rule)
    assert torch.equal(
        total, torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=rule.norm_type)
    )
    assert plan.flag.dtype == torch.bool


@pytest.mark.parametrize("name", CLIP_OPTIONS)
def test_every_threshold_refused_at_zero_and_below(name):
    """Each option of a rule that must be positive (its numbers but norm_type) is refused at 0 and -1, naming it."""
    keys = [
        k
        for k, v in option(name).items()
        if k not in ("_target_", "norm_type") and isinstance(v, int | float)
    ]
    for key in keys:
        for bad in (0, -1):
            with pytest.raises(UserError, match=rf"clip.{key}={bad}"):
                build_clip(option(name, **{key: bad}))


def test_wrong_types_and_unknown_keys_are_one_sentence():
    with pytest.raises(UserError, match=r"clip.max_norm: .*'big'.*see conf/clip/norm.yaml"):
        build_clip(option("norm", max_norm="big"))
    with pytest.raises(UserError, match=r"clip.max_nrom: .*max_nrom"):
        build_clip(option("norm", max_nrom=3.0))
    with pytest.raises(UserError, match="clip.norm_type=3.0 is not supported"):
        build_clip(option("norm", norm_type=3.0))
    with pytest.raises(UserError, match="clip.percentile=101.0 must lie in"):
        build_clip(option("autoclip", percentile=101.0))
    with pytest.raises(UserError, match="clip._target_=no.such.Rule is not an importable class"):
        build_clip({"_target_": "no.such.Rule"})
    with pytest.raises(UserError, match="is not a clip rule"):
        build_clip({"_target_": "collections.OrderedDict"})
    with pytest.raises(UserError, match="clip names no rule"):
        build_clip({"max_norm": 3.0})


@pytest.mark.parametrize("name", CLIP_OPTIONS)
def test_backed_off_scales_the_threshold_and_shares_state(name):
    rule = build_clip(option(name))
    tight = rule.backed_off(0.5)
    if rule.threshold_key is None:
        assert tight is rule and rule.limit() is None
        return
    assert tight.limit() == pytest.approx(rule.limit() * 0.5)
    assert type(tight) is type(rule) and vars(tight).keys() == vars(rule).keys()
    for key, value in vars(rule).items():
        if key not in option(name):  # the rule's state: the same object, not a fresh one
            assert getattr(tight, key) is value


def test_autoclip_state_round_trips():
    rule = build_clip(option("autoclip", history=4))
    for norm in (1.0, 2.0, 3.0):
        rule.norms.append(torch.tensor(norm))
    other = build_clip(option("autoclip", history=4))
    other.load_state_dict(rule.state_dict())
    assert other.norms.count == 3 and other.threshold() == rule.threshold()


@pytest.mark.parametrize("name", CLIP_OPTIONS)
def test_an_old_checkpoints_clip_mode_maps_onto_its_rule(name):
    """The clip section every checkpoint held before the rules: one flat dict of every mode's keys and `mode`."""
    old = {"mode": name, "max_norm": 7.0, "norm_type": 2.0, "value": 0.5, "factor": 0.02, "eps": 1e-3}
    old |= {"percentile": 20.0, "history": 50}
    new = legacy_clip(old)
    rule = build_clip(new)
    assert rule.name == name
    for key in set(new) - {"_target_"}:
        assert getattr(rule, key) == old[key]
