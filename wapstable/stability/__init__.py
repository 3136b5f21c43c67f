"""What keeps a run alive: gradient clipping, the non-finite/spike guard, deliberate faults, anomaly replay."""

from .clipping import AutoClipHistory, clip_gradients, grad_norm

__all__ = ["AutoClipHistory", "clip_gradients", "grad_norm"]
