"""Adding a part is one new Python file and one new yaml, nothing else edited: a clip mode (conf/clip/), an encoder
(conf/model/) and a data source (conf/data/) written into a copy of the package train together through its train.py.
Each kind, kept outside the package and named by its `_target_` with its options refused as the package's own are,
is in tests/test_clip_modes.py, tests/test_watchers.py and tests/test_sources.py (make test-all)."""

import os
import shutil
import subprocess
import sys

from conftest import ROOT, TINY
from test_clip_modes import SCALE_RULE
from test_loggers import read_csv
from test_sources import BARS
from test_sources import YAML as BARS_YAML
from test_watchers import LOADED, MODEL_YAML, STRIDED


def test_a_clip_mode_an_encoder_and_a_data_source_each_one_file_and_one_yaml(tmp_path, cache_dir):
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(
        ROOT / "wapstable", copy / "wapstable", symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(ROOT / "conf", copy / "conf")
    shutil.copy(ROOT / "train.py", copy / "train.py")
    package, conf = copy / "wapstable", copy / "conf"
    (package / "stability" / "clip" / "scale.py").write_text(SCALE_RULE)
    (conf / "clip" / "scale.yaml").write_text(
        "_target_: wapstable.stability.clip.scale.ScaleClip\nfactor: 0.5\n"
    )
    (package / "model" / "watchers" / "strided.py").write_text(STRIDED)
    (conf / "model" / "strided.yaml").write_text(
        MODEL_YAML.format(target="wapstable.model.watchers.strided.StridedWatcher")
    )
    (package / "data" / "sources" / "bars.py").write_text(BARS)
    (conf / "data" / "bars.yaml").write_text(BARS_YAML.format(target="wapstable.data.sources.bars.BarSource"))

    run = tmp_path / "run"
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), "PYTHONPATH": str(copy)}  # the copy's package
    args = [
        "clip=scale",
        "clip.factor=0.25",
        "model=strided",
        "model.watcher.layers=2",
        "data=bars",
        "logger=csv",
    ]
    cmd = [sys.executable, "train.py", *TINY, f"hydra.run.dir={run}", *args]
    proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "model strided" in out and "clip scale" in out  # the run's summary line names both
    assert read_csv(run / "metrics.csv")["train/clipped"] == {
        1: 1.0,
        2: 1.0,
        3: 1.0,
    }  # the rule's flag, every step

    from wapstable.checkpoint import load_checkpoint

    state = load_checkpoint(run / "checkpoints" / "best.pt")
    assert set(state["vocab"]) - {"<eol>"} == {"1"}  # the bars' labels made the vocabulary
    read = subprocess.run(
        [sys.executable, "-c", f"import sys; {LOADED}", str(run / "checkpoints" / "best.pt")],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
    )
    assert read.stdout.strip() == "StridedWatcher 4 8", read.stderr[
        -2000:
    ]  # evaluate.py's loader rebuilds it
