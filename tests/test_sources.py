"""A data source is one Python file and one yaml under conf/data/: written into a copy of the package (nothing else
edited), or kept outside it and named by its `_target_` (a config folder on hydra.searchpath), it trains through
train.py; its own options (data.options) are checked like the package's keys; a `_target_` that is no source is one
sentence (checkpoints from before the sources were `_target_`s: tests/test_old_checkpoints.py)."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, outside_the_package, refusal_in_process

# Images of `strokes` vertical bars, labelled with as many 1s: a source of its own, with its own options.
BARS = """
from dataclasses import dataclass

import numpy as np

from wapstable.data.sample import Sample
from wapstable.data.sources.base import DataSource
from wapstable.errors import UserError


class BarSource(DataSource):
    name = "bars"

    @dataclass
    class Options:
        per_split: int = 24
        most: int = 4

        def __post_init__(self):
            if self.most < 1:
                raise UserError(f"data.options.most={self.most} must be at least 1")

    def splits(self, cfg_data, which):
        out = {}
        for k, split in enumerate(which):
            rng = np.random.default_rng(k)
            samples = []
            for i in range(self.options.per_split):
                n = int(rng.integers(1, self.options.most + 1))
                image = np.zeros((32, 16 * n + 8), np.uint8)
                for j in range(n):
                    image[4:28, 8 + 16 * j : 12 + 16 * j] = 255
                samples.append(Sample(f"{split}-{i}", image, ["1"] * n))
            out[split] = samples
        return out
"""
YAML = "name: bars\n_target_: {target}\noptions:\n  per_split: 24\n  most: 4\n"


def train(cmd_dir, args, run, cache_dir, env_extra):
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), **env_extra}
    cmd = [sys.executable, "train.py", *TINY, f"hydra.run.dir={run}", "data=bars", *args]
    return subprocess.run(cmd, cwd=cmd_dir, env=env, capture_output=True, text=True, timeout=300)


def check_the_bar_source(cmd_dir, tmp_path, cache_dir, args, env):
    from wapstable.checkpoint import load_checkpoint

    run = tmp_path / "run"
    proc = train(cmd_dir, ["data.options.most=3", *args], run, cache_dir, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    assert set(state["vocab"]) - {"<eol>"} == {"1"}  # its labels made the vocabulary
    assert state["config"]["data"]["options"] == {"per_split": 24, "most": 3}
    bad = tmp_path / "bad"
    proc = train(cmd_dir, ["data.options.most=0", *args], bad, cache_dir, env)
    assert proc.returncode == 2 and "data.options.most=0 must be at least 1" in proc.stdout + proc.stderr
    assert not (bad / "checkpoints").exists()


@pytest.mark.slow  # make test-all; make test adds a part to a package copy (tests/test_components.py)
def test_a_data_source_outside_the_package_is_named_by_its_target(tmp_path, cache_dir):
    yaml = YAML.format(target="my_sources.BarSource")
    search, env = outside_the_package(tmp_path, "my_sources", BARS, "data/bars", yaml)
    check_the_bar_source(ROOT, tmp_path, cache_dir, [search], env)


def test_a_target_that_is_no_source_is_one_sentence(tmp_path, cache_dir):
    said = refusal_in_process(["data._target_=no.such.Source"], tmp_path / "a", cache_dir)
    assert said.startswith("data._target_=no.such.Source is not an importable class")
    said = refusal_in_process(["data._target_=collections.OrderedDict"], tmp_path / "b", cache_dir)
    assert "is not a data source" in said
    said = refusal_in_process(["+data.options.x=1"], tmp_path / "c", cache_dir)
    assert said.startswith("data.options.x:")  # the built-in sources have no options of their own
