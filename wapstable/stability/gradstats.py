"""Per-layer gradient statistics (`grad_stats.csv`), their scalars, and TensorBoard histograms.

The usual method against exploding gradients: log every layer's gradient and weight figures, tell gradient explosion
from the statistics, and pick the clip threshold from them (`scripts/grad_report.py` reads the CSV and suggests one).
`StepGuard` calls two hooks: `capture` before clipping, `finish` when the step is done (or skipped).
Figures are computed only every `stats.every` steps and on anomalous steps, which keeps the cost under 1%.
"""

import csv
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from wapstable.errors import UserError

log = logging.getLogger("wapstable")

CSV_NAME = "grad_stats.csv"
GLOBAL = "__global__"  # the name of the row that holds the step's global figures
COLUMNS = [
    "step",
    "name",
    "grad_norm",  # L2 norm of the gradient before clipping; the global row: the norm clipping measures
    "grad_max_abs",
    "grad_mean_abs",
    "nonfinite",  # count of NaN/Inf gradient values
    "param_norm",  # L2 norm of the weights after the step
    "update_ratio",  # ||W_after - W_before|| / ||W_after||; 0 on a skipped step
    "norm_type",  # the norm of grad_norm: 2 per layer; the global row: clip's norm (1, 2 or inf)
    "clipped",
    "skipped",
    "threshold",  # global row: the global-norm threshold in force (norm/inf: max_norm; autoclip: the percentile)
    "grad_norm_clipped",  # global row: the norm after clipping (same norm type)
    "loss",  # global row
]


def validate_stats_config(cfg_stats) -> None:
    """Fail before training on a negative interval; 0 turns a feature off."""
    for key in ("every", "histogram_every", "attention_images"):
        if cfg_stats[key] < 0:
            raise UserError(f"stats.{key}={cfg_stats[key]} must be >= 0 (0 turns it off)")


def _cell(x) -> str | float | int:
    if x is None:
        return ""
    if isinstance(x, bool):
        return int(x)
    return x


class GradStats:
    """Writes per-layer figures on stats steps and on anomalous steps, and histograms.

    `run_dir` None (a non-main DDP rank) turns everything off. `seconds` is the time spent in the hooks.
    """

    def __init__(self, cfg_stats, run_dir, loggers=None, norm_type: float = 2.0):
        validate_stats_config(cfg_stats)
        self.every = int(cfg_stats.every)
        self.histogram_every = int(cfg_stats.histogram_every)
        self.enabled = run_dir is not None
        write_csv = bool(getattr(cfg_stats, "csv", True))
        self.path = Path(run_dir) / CSV_NAME if self.enabled and write_csv else None
        self.loggers = loggers  # a loggers.Loggers: scalars to every logger, pictures to TensorBoard
        self.norm_type = float(norm_type)
        self.pending: dict | None = None
        self.seconds = 0.0

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @property
    def tensorboard(self):
        """The SummaryWriter for histograms, or None when TensorBoard is not among the loggers."""
        return self.loggers.tensorboard if self.loggers is not None else None

    def histogram_due(self, step: int) -> bool:
        return self.tensorboard is not None and self.histogram_every > 0 and step % self.histogram_every == 0

    # ---- hooks ----
    def capture(self, step: int, model: torch.nn.Module, anomalous: bool = False) -> None:
        """Before clipping: per-layer gradient figures (kept on the device) and a copy of the weights."""
        self.pending = None
        if not self.enabled:
            return
        hist, rows = self.histogram_due(step), self.due(step) or anomalous
        if not (hist or rows):
            return
        t0 = time.perf_counter()
        if hist:
            self.histograms(step, model)
        if rows:
            names, params = zip(*model.named_parameters())
            grads = [p.grad.detach() if p.grad is not None else p.new_zeros(()) for p in params]
            l1 = torch.stack(torch._foreach_norm(grads, 1)).double()
            numel = torch.tensor([max(1, g.numel()) for g in grads], dtype=torch.float64, device=l1.device)
            figures = torch.stack(
                [
                    torch.stack(torch._foreach_norm(grads, 2)).double(),
                    torch.stack(torch._foreach_norm(grads, float("inf"))).double(),
                    l1 / numel,
                    torch.stack([(~torch.isfinite(g)).sum() for g in grads]).double(),
                ],
                1,
            )  # (N, 4): norm, max |g|, mean |g|, non-finite count
            glob = torch.stack([figures[:, 1].max(), l1.sum() / numel.sum(), figures[:, 3].sum()])
            # The update ratio needs the weights before the step: copied only here, on stats steps.
            before = [p.detach().clone() for p in params]
            self.pending = dict(
                step=step, names=names, params=params, figures=figures, glob=glob, before=before
            )
        self.seconds += time.perf_counter() - t0

    def finish(self, step: int, result, threshold=None) -> None:
        """After the optimizer step (or the skip): weights and update ratios, then one CSV write per step.
        `threshold()` gives the clip threshold in force (`StepGuard.clip_threshold`), asked only on stats steps:
        autoclip's costs a host sync."""
        p = self.pending
        if p is None or p["step"] != step:
            return
        self.pending = None
        t0 = time.perf_counter()
        params = p["params"]
        after = [q.detach() for q in params]
        param_norm = torch.stack(torch._foreach_norm(after)).double()
        delta = torch.stack(torch._foreach_norm(torch._foreach_sub(after, p["before"]))).double()
        per_layer = torch.cat([p["figures"], param_norm[:, None], delta[:, None]], 1)  # (N, 6)
        g_param = param_norm.square().sum().sqrt()
        g_delta = delta.square().sum().sqrt()
        extra = [g_param, g_delta]
        if not result.skipped:  # the gradients now hold the clipped values
            grads = [q.grad for q in params if q.grad is not None]
            if grads:
                extra.append(torch.nn.utils.get_total_norm(grads, norm_type=self.norm_type).double())
        rows = per_layer.tolist()  # one host sync for the whole table
        glob = torch.cat([p["glob"], torch.stack(extra)]).tolist()
        threshold = threshold() if threshold is not None else None

        flags = [bool(result.clipped), bool(result.skipped)]
        table = []
        for name, (gn, gmax, gmean, bad, pn, dn) in zip(p["names"], rows):
            table.append([step, name, gn, gmax, gmean, int(bad), pn, _ratio(dn, pn), 2, *flags])
        gmax, gmean, gbad, gpn, gdn = glob[:5]
        clipped_norm = glob[5] if len(glob) > 5 else None
        ratio, norm_name = _ratio(gdn, gpn), _norm_name(self.norm_type)
        row = [step, GLOBAL, result.grad_norm, gmax, gmean, int(gbad), gpn, ratio, norm_name, *flags]
        table.append(row + [threshold, clipped_norm, result.loss])
        if self.path is not None:
            self.write_rows(table)
        if self.loggers is not None:
            for tag, value in (
                ("stats/grad_norm_clipped", clipped_norm),
                ("stats/clip_threshold", threshold),
                ("stats/update_ratio", ratio),
                ("stats/param_norm", gpn),
                ("stats/nonfinite_grads", gbad),
            ):
                self.loggers.scalar(tag, value, step + 1)  # steps done, as the trainer's train/* scalars
        self.seconds += time.perf_counter() - t0

    def write_rows(self, table: list[list]) -> None:
        """Append to the CSV and close it, so a crash loses nothing; the header only when the file is new."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.is_file() or self.path.stat().st_size == 0
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(COLUMNS)
            for row in table:
                w.writerow([_cell(x) for x in row] + [""] * (len(COLUMNS) - len(row)))

    def histograms(self, step: int, model: torch.nn.Module) -> None:
        """Per-layer histograms of gradients (before clipping) and weights; non-finite values are left out.

        Binned with torch (64 even bins) and written raw: `add_histogram` copies each tensor to numpy in float64
        and spends most of its time there, and on a GPU only the 64 counts need to leave the device.
        """
        for name, q in model.named_parameters():
            for tag, t in (("grad", q.grad), ("weight", q)):
                if t is None:
                    continue
                values = t.detach().float().flatten()
                values = values[torch.isfinite(values)]
                if not values.numel():
                    continue
                # One host sync per tensor, only every histogram_every steps.
                stats = torch.stack([values.min(), values.max(), values.sum(), values.square().sum()])
                lo, hi, total, squares = stats.tolist()
                top = hi if hi > lo else lo + max(abs(lo), 1.0) * 1e-6  # histc needs a non-empty range
                counts = torch.histc(values, 64, min=lo, max=top).tolist()
                limits = np.linspace(lo, top, 65)[1:].tolist()  # the upper edge of each bin
                self.tensorboard.add_histogram_raw(
                    f"{tag}/{name}", lo, hi, values.numel(), total, squares, limits, counts, step
                )


def _norm_name(norm_type: float) -> str:
    return "inf" if math.isinf(norm_type) else f"{norm_type:g}"


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf
