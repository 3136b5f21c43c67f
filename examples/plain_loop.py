"""The step guard in a training loop of your own: `wapstable.stability.StepGuard`, no Trainer, no Hydra.

    python examples/plain_loop.py

Two models: the gradient-explosion example's LinearNet (a linear layer of ones; inputs like 120 and -200 make its
gradients huge, so it is clipped by the infinity norm to 2, as one would by hand with
`clip_grad_norm_(..., norm_type='inf')`), and
a small network with BatchNorm. In each loop one batch carries a NaN: the guard skips that step and the script
checks that the weights, the optimizer state and BatchNorm's running statistics are bit-identical to before it.
"""

import copy
import sys
import tempfile

import torch
from torch import nn

from wapstable.checkpoint import load_checkpoint
from wapstable.stability import StepGuard


class LinearNet(nn.Module):  # the example's model: weights 1, bias 0
    def __init__(self, features_in=5, features_out=5):
        super().__init__()
        self.linear = nn.Linear(features_in, features_out)
        nn.init.constant_(self.linear.weight, val=1)
        nn.init.constant_(self.linear.bias, val=0)

    def forward(self, x):
        return self.linear(x)


def small_bn_net():
    return nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def state(model, optimizer):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def train(name, model, optimizer, loss_fn, batches, anomaly_dir, **clip) -> bool:
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    guard = StepGuard(
        model, optimizer, scheduler=scheduler, max_consecutive_skips=2, anomaly_dir=anomaly_dir, **clip
    )
    ok = True
    for x, y in batches:
        before = state(model, optimizer)
        loss = loss_fn(model(x), y)
        result = guard.step(loss, batch=(x, y))  # backward, finite check, clip, step or skip
        if result.skipped:
            identical = same(before, state(model, optimizer))
            saved = load_checkpoint(result.anomaly_path)  # weights_only=True inside
            nan_batch_saved = bool(torch.isnan(saved["anomaly"]["batch"][0]).any())
            print(
                f"{name}: step {result.step} skipped ({result.reason}); weights, optimizer state and buffers "
                f"{'bit-identical' if identical else 'CHANGED'}; anomaly checkpoint {result.anomaly_path.name}"
            )
            ok &= identical and nan_batch_saved
        elif result.step % 5 == 0:
            print(
                f"{name}: step {result.step} loss {result.loss:.4g} grad norm {result.grad_norm:.4g} clipped={result.clipped}"
            )
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    print(
        f"{name}: {guard.accepted} steps taken, {guard.budget.total} skipped, {guard.clipped} clipped; finite weights: {finite}"
    )
    return ok and finite and guard.budget.total == 1


def main() -> int:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        # The example's batch, and the same with noise; step 3's input holds a NaN.
        x = torch.tensor([120, 200, 0.5, -200, 1.0])
        target = torch.tensor([2, 1, 5, 10, 40.0])
        batches = [(x + torch.randn(5), target) for _ in range(12)]
        batches[3][0][2] = float("nan")
        net = LinearNet()
        ok = train(
            "LinearNet",
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            nn.L1Loss(),
            batches,
            f"{tmp}/linear",
            clip="inf",
            max_norm=2.0,
        )
        bn_batches = [(torch.randn(8, 5), torch.randn(8, 5)) for _ in range(12)]
        bn_batches[7][0][0, 0] = float("nan")
        bn = small_bn_net()
        ok &= train(
            "BatchNorm net",
            bn,
            torch.optim.Adam(bn.parameters(), lr=1e-2),
            nn.MSELoss(),
            bn_batches,
            f"{tmp}/bn",
            clip="norm",
            max_norm=1.0,
        )
    print("OK: each NaN batch was skipped bit-exactly" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
