"""A watcher is one Python file and one yaml under conf/model/: written into a copy of the package (nothing else
edited), or kept outside it and named by its `_target_` (a config folder on hydra.searchpath), it trains through
train.py and its checkpoint reads back through evaluate.py's loader; its options are checked like the package's own
(checkpoints from before the watchers were `_target_`s: tests/test_old_checkpoints.py)."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, outside_the_package

# Strided 3x3 convs, `layers` of them, each halving the grid; its own options, checked by its own Options.
STRIDED = """
from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

from wapstable.errors import UserError


class StridedWatcher(nn.Module):
    @dataclass
    class Options:
        width: int = 8
        layers: int = 3

    def __init__(self, width: int = 8, layers: int = 3):
        super().__init__()
        if layers < 1:
            raise UserError(f"model.watcher.layers={layers} must be at least 1")
        self.convs = nn.ModuleList(nn.Conv2d(1 if i == 0 else width, width, 3, stride=2, padding=1) for i in range(layers))
        self.out_channels, self.stride = width, 2**layers

    def forward(self, x, mask):
        for conv in self.convs:
            mask = mask[:, :, ::2, ::2]
            x = F.relu(conv(x)) * mask
        return x, mask
"""
MODEL_YAML = "name: strided\nwatcher:\n  _target_: {target}\n  width: 8\n  layers: 3\n"
# evaluate.py's loader rebuilds the model from the checkpoint's own config
LOADED = "from wapstable.eval.evaluation import load_model; m = load_model(sys.argv[1])[0].watcher; print(type(m).__name__, m.stride, m.out_channels)"


def train(cmd_dir, args, run, cache_dir, env_extra):
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), **env_extra}
    cmd = [sys.executable, "train.py", *TINY, f"hydra.run.dir={run}", *args]
    return subprocess.run(cmd, cwd=cmd_dir, env=env, capture_output=True, text=True, timeout=300)


def loaded(cmd_dir, checkpoint, env_extra) -> str:
    env = {**os.environ, **env_extra}
    code = f"import sys; {LOADED}"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint)], cwd=cmd_dir, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def check_the_strided_watcher(cmd_dir, tmp_path, cache_dir, args, env):
    run = tmp_path / "run"
    proc = train(cmd_dir, ["model=strided", "model.watcher.layers=2", *args], run, cache_dir, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model strided" in proc.stdout + proc.stderr
    assert loaded(cmd_dir, run / "checkpoints" / "best.pt", env) == "StridedWatcher 4 8"
    bad = tmp_path / "bad"
    proc = train(cmd_dir, ["model=strided", "model.watcher.layers=0", *args], bad, cache_dir, env)
    assert proc.returncode == 2 and "model.watcher.layers=0 must be at least 1" in proc.stdout + proc.stderr
    assert not (bad / "checkpoints").exists()
    proc = train(cmd_dir, ["model=strided", "model.watcher.width=wide", *args], bad, cache_dir, env)
    assert (
        proc.returncode == 2
        and "model.watcher.width:" in proc.stdout + proc.stderr
        and "wide" in proc.stdout + proc.stderr
    )


@pytest.mark.slow  # make test-all; make test adds a part to a package copy (tests/test_components.py)
def test_a_watcher_outside_the_package_is_named_by_its_target(tmp_path, cache_dir):
    yaml = MODEL_YAML.format(target="my_watchers.StridedWatcher")
    search, env = outside_the_package(tmp_path, "my_watchers", STRIDED, "model/strided", yaml)
    check_the_strided_watcher(ROOT, tmp_path, cache_dir, [search], env)
