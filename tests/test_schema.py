"""Keys with a fixed set of values are Enums in the schema: a wrong value is refused when the config is composed
(command line, YAML, a checkpoint's config), with OmegaConf's message naming the key and the allowed values, and
every allowed value composes. No module checks these values a second time."""

import pytest
from conftest import compose_config, refusal_in_process, require_extra, run_train
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from wapstable import config
from wapstable.config import Config, checkpoint_config
from wapstable.data import schema

# key -> its Enum; the groups whose option sets the key are composed too
ENUM_KEYS = {
    "data.on_error": schema.OnError,
    "data.batch.bucket_by": schema.BucketBy,
    "data.scale": schema.InkScale,
    "data.symbols": schema.SymbolSet,
    "data.style": schema.InkStyle,  # data=synthetic's own keys, on its schema (data.schema.SyntheticData)
    "data.frequencies": schema.Frequencies,
    "data.glyphs": schema.GlyphSource,
    "guard.on_budget_exhausted": config.OnBudgetExhausted,
    "fault.name": config.FaultName,
}


@pytest.mark.parametrize("key", sorted(ENUM_KEYS))
def test_a_wrong_value_is_refused_naming_the_key_and_the_choices(key):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([f"{key}=bogus"])
    message = str(info.value) + str(info.value.__cause__)
    choices = ", ".join(m.value for m in ENUM_KEYS[key])
    assert f"Invalid value 'bogus', expected one of [{choices}]" in message
    assert f"full_key: {key}" in message


@pytest.mark.parametrize("key", sorted(ENUM_KEYS))
def test_every_allowed_value_composes_and_reads_as_a_string(key):
    for member in ENUM_KEYS[key]:
        cfg = compose_config([f"{key}={member.value}"])
        value = OmegaConf.select(cfg, key)
        assert value == member.value and isinstance(value, str)  # a StrEnum: compares with the plain string
        saved = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
        assert type(OmegaConf.select(OmegaConf.create(saved), key)) is str  # checkpoints hold plain strings


def test_wandb_mode_is_checked_by_its_logger_s_schema(tmp_path, cache_dir):
    """logger.wandb.mode against WandbLogger.Options (each logger's keys are its own), before the run starts."""
    require_extra("wandb", "loggers")
    said = refusal_in_process(["logger=wandb", "logger.wandb.mode=onlin"], tmp_path / "run", cache_dir)
    assert said.startswith("logger.wandb.mode: Invalid value 'onlin'") and "offline" in said


def test_a_checkpoint_config_with_a_wrong_value_is_refused():
    saved = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)
    saved["fault"]["name"] = "sometimes"
    with pytest.raises(ValidationError, match="fault.name"):
        checkpoint_config(saved, [], OmegaConf.structured(Config))


def test_train_py_refuses_a_wrong_value_before_writing(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = run_train(["guard.on_budget_exhausted=retry"], run, cache_dir, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Invalid value 'retry', expected one of [stop, rollback]" in out
    assert not (run / "checkpoints").exists()


def test_the_optimizer_is_its_target_with_the_keys_it_takes():
    import torch

    from wapstable.errors import UserError
    from wapstable.train.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    for option, cls in (
        ("adadelta", torch.optim.Adadelta),
        ("adam", torch.optim.Adam),
        ("sgd", torch.optim.SGD),
    ):
        cfg = compose_config([f"optim={option}"])
        opt = build_optimizer(cfg.optim, params)
        assert type(opt) is cls and opt.defaults["lr"] == cfg.optim.lr
    cfg = compose_config(["optim=adam", "optim._target_=torch.optim.AdamW", "optim.weight_decay=0.01"])
    opt = build_optimizer(cfg.optim, params)
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.01
    assert opt.defaults["betas"] == (0.9, 0.999)  # a list in YAML, the tuple torch expects
    cfg.optim._target_ = "torch.optim.Nope"
    with pytest.raises(
        UserError, match="optim._target_=torch.optim.Nope is not an importable optimizer class"
    ):
        build_optimizer(cfg.optim, params)


def test_a_checkpoint_from_before_optim_target_keeps_its_optimizer():
    saved = OmegaConf.to_container(compose_config(["optim=sgd"]), resolve=False, enum_to_str=True)
    for key in ("_target_",):
        del saved["optim"][key]
    saved["run_dir"] = "x"
    merged = checkpoint_config(saved, [], OmegaConf.structured(Config))
    assert merged.optim._target_ == "torch.optim.SGD" and merged.optim.name == "sgd"
