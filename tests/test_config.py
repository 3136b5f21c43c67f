"""Every option of every config group composes; the schema rejects typos and wrong types, naming the key."""

import subprocess
import sys

import pytest
from conftest import ROOT, compose_config
from hydra.errors import ConfigCompositionException

GROUPS = {
    "model": ["small", "wap", "densewap"],
    "data": ["synthetic", "crohme", "wap_pkl"],
    "optim": ["adadelta", "adam", "sgd"],
    "clip": ["none", "norm", "value", "inf", "agc", "autoclip"],
    "fault": ["none", "nan_input", "inf_loss", "lr_spike", "attention_overflow"],
}


def test_group_files_are_the_listed_options():
    for group, options in GROUPS.items():
        found = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        assert found == sorted(options), group


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes(group, option):
    cfg = compose_config([f"{group}={option}"])
    node = cfg[group]
    assert node.name == option if group != "clip" else node.mode == option


def test_defaults():
    cfg = compose_config()
    assert cfg.model.name == "small" and cfg.data.name == "synthetic" and cfg.optim.name == "adadelta"
    assert cfg.clip.mode == "norm" and cfg.clip.max_norm == 100.0
    assert cfg.model.attention.stable is True
    assert cfg.guard.skip_nonfinite and cfg.guard.max_consecutive_skips == 5
    assert (
        cfg.optim.lr == 1.0
        and cfg.optim.rho == 0.95
        and cfg.optim.eps == 1e-6
        and cfg.optim.weight_decay == 1e-4
    )


def test_paper_sizes():
    wap = compose_config(["model=wap"]).model
    assert list(wap.channels) == [32, 64, 64, 128] and wap.convs_per_block == 4 and wap.hidden_dim == 256
    dense = compose_config(["model=densewap"]).model
    assert dense.dense_growth == 24 and dense.dense_layers == 16 and dense.dense_compression == 0.5


def test_unknown_key_rejected():
    with pytest.raises(ConfigCompositionException, match="max_nrom"):
        compose_config(["clip.max_nrom=3"])


def test_wrong_type_rejected():
    with pytest.raises(ConfigCompositionException, match="max_steps"):
        compose_config(["trainer.max_steps=ten"])


def test_cli_errors_name_the_problem():
    def run(*args):
        return subprocess.run(
            [sys.executable, "train.py", *args, "--cfg", "job"], cwd=ROOT, capture_output=True, text=True
        )

    wrong_option = run("clip=foo")
    assert wrong_option.returncode != 0
    assert "Could not find 'clip/foo'" in wrong_option.stderr and "autoclip" in wrong_option.stderr
    typo = run("trainer.max_stepz=3")
    assert typo.returncode != 0 and "max_stepz" in typo.stderr
    ok = run("optim=adam", "trainer.max_steps=200")
    assert ok.returncode == 0 and "max_steps: 200" in ok.stdout and "name: adam" in ok.stdout


def test_help_shows_config():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    assert "clip: agc, autoclip, inf, none, norm, value" in proc.stdout
    assert "max_steps" in proc.stdout
