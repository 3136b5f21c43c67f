"""`clip=agc`: adaptive gradient clipping (Brock et al. 2021, "High-Performance Large-Scale Image Recognition
Without Normalization"): per output unit, if |G|/max(|W|, eps) > factor, G is rescaled to factor*max(|W|, eps).
The model's output layer is left alone, as the paper does (`bind`: the model's `output_layer_names()`)."""

from dataclasses import dataclass

import torch

from wapstable.stability.clip.base import ClipPlan, ClipRule


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """Per output unit: rows of a Linear weight, output channels of a conv; biases and gains elementwise."""
    if x.ndim <= 1:
        return x.abs()
    return x.norm(p=2, dim=tuple(range(1, x.ndim)), keepdim=True)


@dataclass
class AdaptiveClip(ClipRule):
    factor: float = 0.01
    eps: float = 1e-3

    name = "agc"
    threshold_key = "factor"

    def __post_init__(self):
        self.positive("factor", "eps")
        self.skip_ids: set[int] = set()

    def bind(self, model: torch.nn.Module) -> None:
        names = set(model.output_layer_names()) if hasattr(model, "output_layer_names") else set()
        self.leave_alone([p for n, p in model.named_parameters() if n in names])

    def leave_alone(self, parameters) -> None:
        """Parameters this rule never clips (an output layer)."""
        self.skip_ids = {id(p) for p in parameters}

    def plan(self, params, grads, total_norm) -> ClipPlan:
        clipped = torch.zeros((), dtype=torch.bool, device=total_norm.device)
        scales = []
        for p, g in zip(params, grads):
            if id(p) in self.skip_ids:
                continue
            max_norm = unitwise_norm(p.detach()).clamp_min(self.eps) * self.factor
            g_norm = unitwise_norm(g)
            over = g_norm > max_norm
            scales.append((g, torch.where(over, max_norm / g_norm.clamp_min(1e-6), torch.ones_like(g_norm))))
            clipped |= over.any()

        def apply():
            for g, scale in scales:
                g.mul_(scale)

        return ClipPlan(clipped, apply)
