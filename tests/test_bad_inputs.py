"""Bad inputs through the real train.py: each fails with a message naming the problem, a non-zero exit, and
before any file of the run directory is written.

Every case runs into a copy of a finished run's directory; afterwards its files (checkpoints, metrics, vocab.txt,
TensorBoard events) must be byte for byte as they were. Hydra's own files are exempt: it rewrites `.hydra/` and
appends to `train.log` when it starts a job.
"""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, refusal_in_process, run_train

from wapstable import checkpoint
from wapstable.checkpoint import FORMAT, VERSION, load_checkpoint, save_checkpoint
from wapstable.data.sample import Sample
from wapstable.data.sources.wap_pkl import write_wap_split
from wapstable.errors import UserError


@pytest.fixture(scope="module")
def earlier(tmp_path_factory, cache_dir):
    """A finished tiny run: the files that no failed run may touch."""
    run = tmp_path_factory.mktemp("earlier") / "run"
    run_train([], run, cache_dir)
    return run


@pytest.fixture
def run_dir(earlier, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(earlier, run)
    return run


def files(run: Path) -> dict[str, bytes]:
    return {
        p.relative_to(run).as_posix(): p.read_bytes()
        for p in sorted(run.rglob("*"))
        # run.lock holds the PID of the process that holds the lock, so every start rewrites it
        if p.is_file() and p.relative_to(run).parts[0] != ".hydra" and p.name != "run.lock"
    }


def refused(
    proc, run: Path, before: dict[str, bytes], *messages: str, code: int = 2, new_ok: str = ""
) -> None:
    """The run failed with `code` and every message, and left the earlier files of `run` as they were."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-4000:]
    for m in messages:
        assert m in out, (m, out[-4000:])
    assert "Traceback" not in out or code == 1  # Hydra's own errors come with HYDRA_FULL_ERROR's traceback
    after = files(run)
    log_before, log_after = before.pop("train.log"), after.pop("train.log")
    assert log_after.startswith(log_before)  # appended to, not rewritten
    for name, data in before.items():
        assert after.get(name) == data, f"{name} was changed"
    new = [name for name in after.keys() - before.keys() if not (new_ok and name.startswith(new_ok))]
    assert not new, f"new files in the run directory: {new}"


def train_into(run, cache_dir, *args):
    return run_train(list(args), run, cache_dir, check=False)


# ---- config ----


BAD_CONFIG = [
    (["clip=foo"], 1, ["Could not find 'clip/foo'", "autoclip"]),  # unknown group option
    (["trainer.max_steps=ten"], 1, ["trainer.max_steps", "'ten'"]),  # wrong type
    (["clip.max_norm=-1"], 2, ["error: clip.max_norm=-1.0 must be positive for clip=norm"]),
    (["clip=value", "clip.value=0"], 2, ["error: clip.value=0.0 must be positive for clip=value"]),
    (["trainer.max_steps=0"], 2, ["error: trainer.max_steps=0 must be a positive number of steps"]),
    (["data.batch.bucket_by=width"], 1, ["Invalid value 'width', expected one of [size, tokens]"]),
    (
        ["optim._target_=torch.optim.Nope"],
        2,
        ["error: optim._target_=torch.optim.Nope is not an importable optimizer class"],
    ),
    (
        ["guard.snapshot_every=-1"],
        2,
        ["error: guard.snapshot_every and guard.max_rollbacks must be >= 0"],
    ),
    (["guard.lr_backoff=2"], 2, ["error: guard.lr_backoff and guard.clip_backoff must be in (0, 1]"]),
    (["model.watcher.block_convs=[1,2]"], 2, ["error: model.watcher.block_convs=[1, 2] must give one count"]),
    (
        ["model.attention.position_features=6"],
        2,
        ["model.attention.position_features must be a multiple"],
    ),
    (["trainer.threads=-3"], 2, ["error: trainer.threads=-3 is not a thread count; use auto"]),
    (["trainer.threads=many"], 2, ["error: trainer.threads=many is not a thread count; use auto"]),
    (["decode.scales=[1.0,0]"], 2, ["error: decode.scales=[1.0, 0.0] must list one or more factors in"]),
]
BAD_CONFIG_IDS = [
    "unknown-option",
    "wrong-type",
    "negative-clip",
    "zero-clip",
    "zero-steps",
    "bucket",
    "optimizer-class",
    "snapshot-every",
    "backoff",
    "block-convs",
    "positions",
    "negative-threads",
    "threads-word",
    "test-scales",
]
# through train.py in make test: Hydra's refusals (exit 1) and one of train()'s (exit 2); the rest under make test-all
BY_TRAIN_PY = {"unknown-option", "wrong-type", "zero-steps"}


@pytest.mark.parametrize(
    "args,code,messages",
    [
        c if name in BY_TRAIN_PY else pytest.param(*c, marks=pytest.mark.slow)
        for c, name in zip(BAD_CONFIG, BAD_CONFIG_IDS)
    ],
    ids=BAD_CONFIG_IDS,
)
def test_bad_config(run_dir, cache_dir, args, code, messages):
    before = files(run_dir)
    refused(train_into(run_dir, cache_dir, *args), run_dir, before, *messages, code=code)


@pytest.mark.parametrize(
    "args,messages",
    [(args, messages) for args, code, messages in BAD_CONFIG if code == 2],
    ids=[name for (_, code, _), name in zip(BAD_CONFIG, BAD_CONFIG_IDS) if code == 2],
)
def test_bad_config_in_process(tmp_path, cache_dir, args, messages):
    """Each of train()'s refusals (exit 2 from train.py), in this process: the sentence, before anything is written."""
    said = refusal_in_process(args, tmp_path / "run", cache_dir)
    for words in messages:
        assert words.removeprefix("error: ") in said


# ---- data ----


def wap_data(root: Path, train=None, captions=None, dictionary=None) -> Path:
    """A tiny data set in WAP's format; `train`, `captions`, `dictionary` replace the train images, captions or
    the dictionary file."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        img = np.zeros((12, 20), np.uint8)
        img[3:9, 4:16] = 255
        samples = [
            Sample(f"{split}-{i}", np.roll(img, i, axis=1), ["x", "^", "{", "2", "}"]) for i in range(4)
        ]
        write_wap_split(samples, root / f"offline-{split}.pkl", root / f"{split}_caption.txt")
    if train is not None:
        (root / "offline-train.pkl").write_bytes(pickle.dumps(train))
    if captions is not None:
        (root / "train_caption.txt").write_text(captions)
    (root / "dictionary.txt").write_text(dictionary or "<eol>\t0\nx\t1\n^\t2\n{\t3\n}\t4\n2\t5\n")
    return root


def test_missing_data_directory(run_dir, cache_dir, tmp_path):
    before = files(run_dir)
    missing = tmp_path / "no-such-folder"
    proc = train_into(run_dir, cache_dir, "data=wap_pkl", f"data.root={missing}")
    refused(proc, run_dir, before, f"error: data.root={missing} is not a folder")


def test_empty_synthetic_data_set(run_dir, cache_dir):
    before = files(run_dir)
    proc = train_into(run_dir, cache_dir, "data.num_train=0")
    refused(proc, run_dir, before, "error: data.num_train=0 leaves the synthetic train split empty")


def test_empty_data_set(run_dir, cache_dir, tmp_path):
    root = wap_data(tmp_path / "data", train={}, captions="")
    before = files(run_dir)
    proc = train_into(run_dir, cache_dir, "data=wap_pkl", f"data.root={root}")
    refused(proc, run_dir, before, f"error: the train split of data=wap_pkl under {root} is empty")


def test_corrupt_image(run_dir, cache_dir, tmp_path):
    garbage = np.frombuffer(b"\x89PNG\r\n\x1a\n truncated", np.uint8)  # a flat byte string, not an image
    root = wap_data(tmp_path / "data", train={"bad": garbage}, captions="bad\tx\n")
    before = files(run_dir)
    proc = train_into(run_dir, cache_dir, "data=wap_pkl", f"data.root={root}")
    refused(proc, run_dir, before, "the image of 'bad' has shape (18,), expected [C, H, W] or [H, W]")


def test_label_with_unknown_token(run_dir, cache_dir, tmp_path):
    root = wap_data(tmp_path / "data", dictionary="<eol>\t0\nx\t1\n^\t2\n{\t3\n}\t4\n")  # no "2"
    before = files(run_dir)
    proc = train_into(run_dir, cache_dir, "data=wap_pkl", f"data.root={root}")
    refused(
        proc,
        run_dir,
        before,
        "error: the label of sample train-0 contains the token '2', which is not in the vocabulary",
        "data.on_error=skip",
    )


# ---- checkpoints ----


def test_truncated_checkpoint(run_dir, cache_dir):
    last = run_dir / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:2000])  # as a copy that ran out of space would leave it
    before = files(run_dir)
    proc = train_into(run_dir, cache_dir, "resume=auto")
    refused(proc, run_dir, before, f"error: {last} is truncated or not a checkpoint")


def test_checkpoint_of_another_model_size(run_dir, cache_dir):
    before = files(run_dir)
    proc = train_into(run_dir, cache_dir, "resume=auto", "model.hidden_dim=24")
    refused(proc, run_dir, before, "holds a model of another size", "resume with the model config")


@pytest.mark.parametrize("kind", ["text", "foreign"])
def test_file_that_is_not_a_checkpoint(run_dir, cache_dir, tmp_path, kind):
    path = tmp_path / "weights.pt"
    if kind == "text":
        path.write_text("model: small\n")
        message = f"error: {path} is truncated or not a checkpoint"
    else:  # a real torch file, from another program
        torch.save({"encoder.weight": torch.ones(2, 2)}, path)
        message = f"error: {path} is not a wapstable checkpoint"
    before = files(run_dir)
    refused(train_into(run_dir, cache_dir, f"resume={path}"), run_dir, before, message)


class Evil:
    """Pickles as a call to os.system: loading it without weights_only would run the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_checkpoint_with_a_pickled_object_is_refused(run_dir, cache_dir, tmp_path):
    ran = tmp_path / "code-ran"
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    state["evil"] = Evil(f"touch {ran}")
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "version": VERSION, "checksum": "", "state": state}, path)
    before = files(run_dir)
    proc = train_into(run_dir, cache_dir, f"resume={path}")
    refused(
        proc, run_dir, before, f"error: checkpoint {path} carries a pickled Python object", "weights_only"
    )
    assert not ran.exists()


# ---- a full disk ----

# train.py with every checkpoint write going to /dev/full: the temporary file is created, its writes fail with
# ENOSPC, through the real torch.save and file buffering.
FULL_DISK = r"""
import os, runpy, sys, tempfile, types
from pathlib import Path

import wapstable.checkpoint


def mkstemp(*args, **kwargs):
    fd, name = tempfile.mkstemp(*args, **kwargs)
    os.close(fd)
    return os.open("/dev/full", os.O_WRONLY), name


wapstable.checkpoint.tempfile = types.SimpleNamespace(mkstemp=mkstemp)
sys.argv[0] = str(Path.cwd() / "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""
needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")


def full_disk(monkeypatch):
    def mkstemp(*args, **kwargs):
        fd, name = tempfile.mkstemp(*args, **kwargs)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(checkpoint, "tempfile", types.SimpleNamespace(mkstemp=mkstemp))


@pytest.mark.slow  # make test-all
@needs_dev_full
def test_full_disk_stops_the_run(run_dir, cache_dir):
    # resumes at step 3 and fails at its first checkpoint, at step 6
    cmd = [
        sys.executable,
        "-c",
        FULL_DISK,
        *TINY,
        f"hydra.run.dir={run_dir}",
        "resume=auto",
        "trainer.max_steps=6",
    ]
    before = files(run_dir)
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    checkpoints = run_dir / "checkpoints"
    refused(
        proc,
        run_dir,
        before,
        f"error: the disk is full (No space left on device) while writing checkpoint {checkpoints}",
        "is intact",
        "resume=auto",
        new_ok="tb/",  # the resumed run had started: its TensorBoard file is new, not an earlier one
    )
    assert not list(checkpoints.glob("*.tmp"))


@needs_dev_full
@pytest.mark.parametrize("size", [10, 1_000_000], ids=["fits-the-buffer", "fails-inside-torch-save"])
def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, size):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    before = path.read_bytes()
    full_disk(monkeypatch)
    with pytest.raises(UserError, match=f"the disk is full .* while writing checkpoint {path}; nothing was"):
        save_checkpoint({"step": 2, "w": torch.zeros(size)}, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["last.pt"]


# ---- format version and checksum ----


@pytest.mark.parametrize("damage", ["version", "checksum", "missing"])
def test_version_and_checksum_are_checked(tmp_path, damage):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1, "model": {"w": torch.ones(3)}}, path)
    payload = torch.load(path, weights_only=True)
    if damage == "version":
        payload["version"] = VERSION + 1
        message = f"has checkpoint format version {VERSION + 1}, this trainer reads version {VERSION}"
    elif damage == "checksum":
        payload["state"]["model"]["w"][1] = 2.0  # one weight changed, the checksum not
        message = "failed its checksum"
    else:
        path = tmp_path / "nope.pt"
        message = "does not exist"
    if damage != "missing":
        torch.save(payload, path)
    with pytest.raises(UserError, match=message):
        load_checkpoint(path)
