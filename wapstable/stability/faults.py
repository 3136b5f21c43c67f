"""Deliberate faults (config group `fault`), one dispatch point: for demos, tests, and checking a setup.

`fault.step` is the first step it fires, `fault.steps` how many steps in a row, `fault.rank` which process.
"""

import os
import signal

import torch

from wapstable.errors import UserError


class Fault:
    def __init__(
        self, cfg_fault, rank: int = 0, preempt_signal: int | None = getattr(signal, "SIGUSR2", None)
    ):
        if cfg_fault.step < 0 or cfg_fault.steps < 1:
            raise UserError(
                f"fault.step={cfg_fault.step} must be >= 0 and fault.steps={cfg_fault.steps} >= 1"
            )
        self.name, self.first, self.steps = cfg_fault.name, cfg_fault.step, cfg_fault.steps
        self.scale, self.here = cfg_fault.scale, cfg_fault.rank == rank
        # The cluster's preemption signal, which fault=preempt sends (submitit: SUBMITIT_PREEMPT_SIGNAL).
        self.preempt_signal = preempt_signal

    def active(self, step: int) -> bool:
        return self.name != "none" and self.here and self.first <= step < self.first + self.steps

    def batch(self, images: torch.Tensor, step: int) -> torch.Tensor:
        """nan_input: one NaN pixel in the first image, which convolutions spread to the loss."""
        if self.name == "nan_input" and self.active(step):
            images = images.clone()
            images[0, 0, 0, 0] = float("nan")
        return images

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """inf_loss: the loss times inf; its gradients turn NaN/Inf."""
        if self.name == "inf_loss" and self.active(step):
            return loss * float("inf")
        return loss

    def lr_multiplier(self, step: int) -> float:
        """lr_spike: the step's learning rate times fault.scale, so the weights blow up."""
        return self.scale if self.name == "lr_spike" and self.active(step) else 1.0

    def energy_scale(self, step: int) -> float:
        """attention_overflow: attention energies times fault.scale, so the naive exp/mask/divide softmax overflows."""
        return self.scale if self.name == "attention_overflow" and self.active(step) else 1.0

    def preempt(self, step: int) -> None:
        """preempt: the process sends itself the cluster's preemption signal (SIGUSR2) during the step, as SLURM
        does before a time limit: checks that a job checkpoints, requeues and resumes."""
        if self.name == "preempt" and self.active(step):
            os.kill(os.getpid(), self.preempt_signal)
