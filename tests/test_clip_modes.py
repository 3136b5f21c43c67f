"""A clip mode is one Python file and one yaml: written into a copy of the package (nothing else edited), or kept
outside it and named by its `_target_` (a config folder on hydra.searchpath), it trains through train.py, its options
are checked like the package's own (checkpoints from before the rules: tests/test_old_checkpoints.py)."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, outside_the_package
from test_loggers import read_csv

# A rule that scales every gradient by `factor` (< 1: every step is "clipped"); its own option, checked.
SCALE_RULE = """
from dataclasses import dataclass

import torch

from wapstable.errors import UserError
from wapstable.stability.clip.base import ClipPlan, ClipRule


@dataclass
class ScaleClip(ClipRule):
    factor: float = 0.5

    name = "scale"
    threshold_key = "factor"

    def __post_init__(self):
        if not 0 < self.factor <= 1:
            raise UserError(f"clip.factor={self.factor} must lie in (0, 1] for clip=scale")

    def plan(self, params, grads, total_norm):
        factor = self.factor

        def apply():
            torch._foreach_mul_(grads, factor)

        return ClipPlan(torch.tensor(factor < 1.0, device=total_norm.device), apply)
"""


def train(cmd_dir, args, run, cache_dir, env_extra=None):
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), **(env_extra or {})}
    cmd = [sys.executable, "train.py", *TINY, "logger=csv", f"hydra.run.dir={run}", *args]
    return subprocess.run(cmd, cwd=cmd_dir, env=env, capture_output=True, text=True, timeout=300)


def check_the_scale_rule(proc, run, bad):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "clip scale" in proc.stdout + proc.stderr  # the run's summary line names the rule
    clipped = read_csv(run / "metrics.csv")["train/clipped"]
    assert clipped == {1: 1.0, 2: 1.0, 3: 1.0}  # its flag, every step
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "clip.factor=2.0 must lie in (0, 1] for clip=scale" in bad.stdout + bad.stderr


@pytest.mark.slow  # make test-all; make test adds a part to a package copy (tests/test_components.py)
def test_a_clip_mode_outside_the_package_is_named_by_its_target(tmp_path, cache_dir):
    yaml = "_target_: my_rules.ScaleClip\nfactor: 0.5\n"
    search, env = outside_the_package(tmp_path, "my_rules", SCALE_RULE, "clip/scale", yaml)
    run = tmp_path / "run"
    proc = train(ROOT, [search, "clip=scale"], run, cache_dir, env)
    bad = train(ROOT, [search, "clip=scale", "clip.factor=2"], tmp_path / "bad", cache_dir, env)
    check_the_scale_rule(proc, run, bad)
