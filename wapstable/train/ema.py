"""The exponential moving average of a run's weights (trainer.ema_decay): after every step the optimizer applied,
averaged = d * averaged + (1 - d) * weights, parameters and buffers alike (torch's AveragedModel), with
d = min(decay, (1 + n) / (10 + n)) after n updates: a warm-up, so that the average of a young run (the first
validations, a short pretraining) is not mostly its random initialisation (0.999 ** 500 = 0.61 of it at step 500).

With it on, the averaged weights are the run's model for everything that reads: validation (and so best.pt),
the read range, the final test, and every checkpoint's `ema` entry, which evaluate.py, predict.py and init_from
load in place of the training weights (`checkpoint.inference_weights`). The training weights stay under `model`:
resume, rollback and an anomaly replay start from them. A skipped step leaves the average as it is."""

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class WeightAverage:
    """The averaged copy of `model`, starting from its weights as they are now."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = float(decay)
        self.averaged = AveragedModel(model, multi_avg_fn=self.average, use_buffers=True)
        self.averaged.requires_grad_(False)

    def average(self, averaged: list, current: list, n) -> None:
        """The update after `n` updates (AveragedModel's multi_avg_fn): torch's EMA at the warmed-up decay."""
        get_ema_multi_avg_fn(warmed_decay(self.decay, int(n)))(averaged, current, n)

    @property
    def module(self) -> torch.nn.Module:
        """The averaged model, a model of the same class as the one trained."""
        return self.averaged.module

    @property
    def updates(self) -> int:
        return int(self.averaged.n_averaged)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Average in `model`'s weights after a step (the first update copies them)."""
        self.averaged.update_parameters(model)

    @torch.no_grad()
    def restore(self, state: dict | None, model: torch.nn.Module) -> None:
        """The average of a saved state; where it has none (trainer.ema_decay turned on at a resume), start again
        from `model`'s weights as loaded."""
        if state:
            self.load_state_dict(state)
        else:
            self.module.load_state_dict(model.state_dict())
            self.averaged.n_averaged.zero_()

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "weights": self.module.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["weights"])
        self.averaged.n_averaged.fill_(int(state["updates"]))


def warmed_decay(decay: float, n: int) -> float:
    """The decay of the update after `n` updates: `decay`, or less while (1 + n) / (10 + n) is less."""
    return min(decay, (1 + n) / (10 + n))
