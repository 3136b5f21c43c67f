"""Resume is bit-identical beyond fp32 with clip=norm (tests/test_train.py): with AutoClip's grad-norm history, the
spike detector's window and fp16's GradScaler, N steps straight end where N/2 steps, a checkpoint and a resume for
N/2 more end, every tensor and counter of the training state equal. In process, through `Trainer.fit`."""

import pytest
import torch
from conftest import SPIKE_AT_STEP_5, TINY, assert_identical, build_trainer

from wapstable.checkpoint import load_checkpoint

N = 8
COMMON = [
    *TINY,
    f"trainer.eval_every={N // 2}",
    f"trainer.checkpoint_every={N // 2}",
    "decode.final_beam_size=1",
    "logger=[]",
]
CASES = {
    # AutoClip's threshold is a percentile of every grad norm so far: a resumed run must carry the history.
    "autoclip": ["clip=autoclip"],
    # An lr spike at step 4 (the first step after the resume) makes step 5's loss a spike, which only the window
    # of steps 0-4 can tell: a resumed run with an empty window would take it.
    "spike_window": [
        *SPIKE_AT_STEP_5,
        "guard.max_consecutive_skips=10",
    ],
    # fp16 on the CPU: the GradScaler's scale and growth tracker go on where they were.
    "fp16_scaler": ["trainer.precision=fp16"],
    # the average of the weights (trainer.ema_decay) and its count of updates go on where they were
    "ema": ["trainer.ema_decay=0.5"],
}
# The training state of last.pt (not the config, which names the resume, nor the clock or the evaluations).
KEYS = ("step", "model", "ema", "optimizer", "scheduler", "scaler", "guard", "counters", "stream", "rollback")


def fit(run_dir, cache_dir, *overrides):
    build_trainer([*COMMON, *overrides], run_dir, cache_dir).fit()
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bit_identical(tmp_path, cache_dir, case):
    straight = fit(tmp_path / "straight", cache_dir, *CASES[case], f"trainer.max_steps={N}")
    half = fit(tmp_path / "first", cache_dir, *CASES[case], f"trainer.max_steps={N // 2}")
    resumed = fit(
        tmp_path / "resumed",
        cache_dir,
        *CASES[case],
        f"trainer.max_steps={N}",
        f"resume={tmp_path / 'first' / 'checkpoints' / 'last.pt'}",
    )
    # The state the resume has to carry is not the one a fresh run starts with, so dropping it shows.
    if case == "autoclip":
        assert half["guard"]["clip"]["history"]["count"] == N // 2
        assert straight["counters"]["clipped"] > half["counters"]["clipped"]  # clipped after the resume too
    elif case == "spike_window":
        assert len(half["guard"]["spikes"]["losses"]) == N // 2
        assert straight["guard"]["budget"]["spikes"] >= 1 and half["guard"]["budget"]["spikes"] == 0
    elif case == "ema":
        assert half["ema"]["updates"] == N // 2 and straight["ema"]["updates"] == N
        model, average = straight["model"], straight["ema"]["weights"]
        assert any(not torch.equal(model[k], average[k]) for k in model if model[k].is_floating_point())
    else:
        fresh = torch.amp.GradScaler("cpu").state_dict()
        assert half["scaler"] and half["scaler"] != fresh
        assert straight["counters"]["accepted"] > 0
    assert resumed["step"] == straight["step"] == N
    assert_identical({k: straight[k] for k in KEYS}, {k: resumed[k] for k in KEYS})
    assert torch.equal(straight["rng"]["torch"], resumed["rng"]["torch"])
