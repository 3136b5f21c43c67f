"""What keeps a run alive: the step guard, gradient clipping, spike detection, deliberate faults, anomaly replay.

`StepGuard` is the piece to use from any PyTorch loop (see `examples/plain_loop.py`).
"""

from wapstable.stability.clip import AutoClipHistory, ClipRule, build_clip, clip_gradients, grad_norm
from wapstable.stability.guard import SkipBudget, SpikeDetector
from wapstable.stability.step_guard import Outcome, StepGuard, StepResult

__all__ = [
    "AutoClipHistory",
    "ClipRule",
    "Outcome",
    "SkipBudget",
    "SpikeDetector",
    "StepGuard",
    "StepResult",
    "build_clip",
    "clip_gradients",
    "grad_norm",
]
