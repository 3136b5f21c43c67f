"""Read the `grad_stats.csv` of one or more runs; draw `grad_report.png`, write `grad_report.md`, suggest thresholds.

    wapstable-grad-report RUN_DIR [RUN_DIR ...] [--out DIR] [--percentiles 50 75 90 95 99]
    python scripts/grad_report.py RUN_DIR ...          # the same, in a checkout

The usual advice: decide from the logged statistics whether gradients explode, and take the clip threshold from
them. The threshold suggested for percentile p is the p-th percentile of the recorded global norms, so clipping at
it would have touched about (100-p)% of the recorded steps. Several runs (say one per clip mode) share one figure.
The files go to the run directory for one run, to the runs' common parent folder for several, or to --out.
"""

import argparse
import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

from wapstable.cli import run_script
from wapstable.errors import UserError
from wapstable.stability.gradstats import CSV_NAME, GLOBAL

PERCENTILES = [50.0, 75.0, 90.0, 95.0, 99.0]


@dataclass
class Run:
    label: str
    clip: str  # the clip mode, from the run's Hydra config when it has one
    steps: np.ndarray  # (S,) recorded steps, sorted
    norm: np.ndarray  # (S,) global norm before clipping (the norm clipping measures)
    norm_type: str
    threshold: np.ndarray  # (S,) the threshold in force, NaN where none
    clipped: np.ndarray  # (S,) bool
    skipped: np.ndarray  # (S,) bool
    nonfinite: np.ndarray  # (S,) count of NaN/Inf gradient values
    layers: list[str]
    layer_norm: np.ndarray  # (L, S) per-layer L2 gradient norms
    layer_bad: np.ndarray  # (L, S) per-layer non-finite counts


def _float(x: str) -> float:
    return float(x) if x not in ("", None) else math.nan


def _norm_type_name(x: str) -> str:
    return {"2": "L2", "2.0": "L2", "1": "L1", "1.0": "L1", "inf": "Linf"}.get(x, f"L{x}")


def load_run(run_dir: Path) -> Run:
    path = run_dir / CSV_NAME
    if not path.is_file():
        raise UserError(f"{path} does not exist; train with stats.every > 0 (and stats.csv=true) to write it")
    rows = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows[int(row["step"]), row["name"]] = row  # a resumed run may redo steps: the last write wins
    glob = sorted((k[0], r) for k, r in rows.items() if k[1] == GLOBAL)
    if not glob:
        raise UserError(f"{path} holds no step yet")
    steps = np.array([s for s, _ in glob])
    col = {s: j for j, s in enumerate(steps)}
    layers = list(dict.fromkeys(name for (_, name) in rows if name != GLOBAL))
    li = {n: i for i, n in enumerate(layers)}
    layer_norm = np.full((len(layers), len(steps)), np.nan)
    layer_bad = np.zeros((len(layers), len(steps)))
    for (step, name), r in rows.items():
        if name != GLOBAL and step in col:
            layer_norm[li[name], col[step]] = _float(r["grad_norm"])
            layer_bad[li[name], col[step]] = _float(r["nonfinite"])
    clip = "?"
    hydra_dir = run_dir / ".hydra"
    if (hydra_dir / "hydra.yaml").is_file():  # the clip option the run chose (clip=NAME)
        from omegaconf import OmegaConf

        clip = str(
            OmegaConf.select(
                OmegaConf.load(hydra_dir / "hydra.yaml"), "hydra.runtime.choices.clip", default="?"
            )
        )
    if clip == "?" and (hydra_dir / "config.yaml").is_file():  # a run from before the clip rules: clip.mode
        from omegaconf import OmegaConf

        clip = str(OmegaConf.select(OmegaConf.load(hydra_dir / "config.yaml"), "clip.mode", default="?"))
    g = [r for _, r in glob]
    return Run(
        label=f"{run_dir.resolve().name} (clip={clip})",
        clip=clip,
        steps=steps,
        norm=np.array([_float(r["grad_norm"]) for r in g]),
        norm_type=g[-1]["norm_type"],
        threshold=np.array([_float(r["threshold"]) for r in g]),
        clipped=np.array([r["clipped"] == "1" for r in g]),
        skipped=np.array([r["skipped"] == "1" for r in g]),
        nonfinite=np.array([_float(r["nonfinite"]) for r in g]),
        layers=layers,
        layer_norm=layer_norm,
        layer_bad=layer_bad,
    )


def suggest(norms: np.ndarray, percentiles=PERCENTILES) -> list[tuple[float, float, float]]:
    """(p, threshold, share of steps it would have clipped) from the finite recorded global norms."""
    x = norms[np.isfinite(norms)]
    if not len(x):
        return []
    return [(p, float(np.percentile(x, p)), float(np.mean(x > np.percentile(x, p)))) for p in percentiles]


def dominant_layers(run: Run, top: int = 8) -> list[tuple[str, float, float, float]]:
    """(layer, mean share of the squared global L2 norm, median norm, max norm), largest share first."""
    ok = np.isfinite(run.layer_norm).all(0)  # steps where every layer's norm is finite
    if not ok.any():
        return []
    sq = run.layer_norm[:, ok] ** 2
    share = (sq / np.maximum(sq.sum(0, keepdims=True), 1e-300)).mean(1)
    med, mx = np.median(run.layer_norm[:, ok], 1), np.max(run.layer_norm[:, ok], 1)
    order = np.argsort(-share)[:top]
    return [(run.layers[i], float(share[i]), float(med[i]), float(mx[i])) for i in order]


def anomalies(run: Run) -> list[tuple[int, bool, int, list[str]]]:
    """(step, skipped, non-finite values, layers with non-finite gradients) of skipped or non-finite steps."""
    out = []
    for j, step in enumerate(run.steps):
        if run.skipped[j] or run.nonfinite[j] > 0 or not np.isfinite(run.norm[j]):
            bad = [run.layers[i] for i in np.nonzero(run.layer_bad[:, j] > 0)[0]]
            out.append((int(step), bool(run.skipped[j]), int(run.nonfinite[j]), bad))
    return out


def clip_setting(run: Run) -> str:
    """Which setting a suggested threshold is for: the global norm the run measured."""
    if run.norm_type in ("inf", "inf.0"):
        return "clip=inf clip.max_norm"
    if run.norm_type in ("1", "1.0"):
        return "clip=norm clip.norm_type=1 clip.max_norm"
    return "clip=norm clip.max_norm"


# ---- the figure ----
def draw(runs: list[Run], path: Path, top: int = 8) -> None:
    n = len(runs)
    fig = Figure(figsize=(6.5 * n, 13), dpi=100)
    axes = fig.subplots(3, n, squeeze=False, gridspec_kw={"height_ratios": [1.0, 1.5, 1.0]})
    finite = [r.layer_norm[np.isfinite(r.layer_norm) & (r.layer_norm > 0)] for r in runs]
    finite = np.concatenate(finite) if any(len(f) for f in finite) else np.array([1e-3, 1.0])
    vmin, vmax = np.percentile(finite, 1), finite.max()  # one colour scale for all runs, so they compare
    top_axes = axes[0]
    for c, run in enumerate(runs):
        group = [
            r for r in runs if r.norm_type == run.norm_type
        ]  # one scale for the runs whose norms compare
        first = runs.index(group[0])
        if first < c:
            top_axes[c].sharey(top_axes[first])
        draw_global(top_axes[c], run, np.concatenate([plotted(r) for r in group]))
        draw_heatmap(fig, axes[1, c], run, vmin, vmax)
        draw_top_layers(axes[2, c], run, top)
    fig.suptitle("gradient statistics (grad_stats.csv)", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path)


def plotted(run: Run) -> np.ndarray:
    """The positive finite values a global-norm panel shows: norms and thresholds."""
    v = np.concatenate([run.norm, run.threshold])
    return v[np.isfinite(v) & (v > 0)]


def draw_global(ax, run: Run, shown: np.ndarray) -> None:
    ok = np.isfinite(run.norm) & (run.norm > 0)
    ax.semilogy(
        run.steps[ok], run.norm[ok], "-", color="tab:blue", lw=1, marker=".", ms=4, label="global norm"
    )
    has_thr = np.isfinite(run.threshold)
    if has_thr.any():
        ax.step(run.steps[has_thr], run.threshold[has_thr], "--", color="tab:red", lw=1.2, where="post",
                label="clip threshold")  # fmt: skip
    c = run.clipped & ok
    if c.any():
        ax.plot(run.steps[c], run.norm[c], "o", mfc="none", color="tab:orange", ms=7, label="clipped")
    for k, s in enumerate(run.steps[run.skipped]):
        ax.axvline(s, color="crimson", lw=1, alpha=0.6, label="skipped" if k == 0 else None)
    bad = ~np.isfinite(run.norm)
    if bad.any():  # a NaN/Inf norm has no place on a log axis: mark it on the top edge
        ax.plot(run.steps[bad], np.ones(bad.sum()), "x", color="crimson", ms=9, mew=2,
                transform=ax.get_xaxis_transform(), clip_on=False, label="non-finite norm")  # fmt: skip
    ax.set_title(
        f"{run.label}\nglobal gradient norm before clipping ({_norm_type_name(run.norm_type)})", fontsize=10
    )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="both", alpha=0.3)
    decades = math.log10(shown.max() / shown.min()) if len(shown) else 1.0
    subs = np.arange(1.0, 10.0) if decades < 1.5 else (1.0, 2.0, 5.0) if decades < 4 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(subs=subs))  # enough labelled ticks for a narrow range too
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.legend(fontsize=8, loc="best", framealpha=0.8)


def draw_heatmap(fig, ax, run: Run, vmin: float, vmax: float) -> None:
    import matplotlib as mpl

    data = np.ma.masked_invalid(np.where(run.layer_norm > 0, run.layer_norm, np.nan))
    cmap = mpl.colormaps["viridis"].with_extremes(bad="magenta")  # NaN/Inf gradients stand out
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=LogNorm(vmin, vmax))
    L, S = data.shape
    ys = np.arange(0, L, max(1, math.ceil(L / 45)))
    ax.set_yticks(ys, [run.layers[i] for i in ys], fontsize=5)
    xs = np.arange(0, S, max(1, math.ceil(S / 12)))
    ax.set_xticks(xs, [str(run.steps[i]) for i in xs], fontsize=7, rotation=45)
    ax.set_xlabel("recorded step (one column each; magenta = non-finite)")
    ax.set_title("per-layer gradient norm (L2)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.01)


def draw_top_layers(ax, run: Run, top: int) -> None:
    dom = dominant_layers(run, top)
    if not dom:
        ax.text(0.5, 0.5, "no step with all-finite gradients", ha="center", transform=ax.transAxes)
        ax.axis("off")
        return
    names = [d[0] for d in dom][::-1]
    shares = [100 * d[1] for d in dom][::-1]
    bars = ax.barh(range(len(dom)), shares, color="tab:purple")
    for b, d in zip(bars, dom[::-1]):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" median {d[2]:.3g}, max {d[3]:.3g}",
                va="center", fontsize=7)  # fmt: skip
    ax.set_yticks(range(len(dom)), names, fontsize=7)
    ax.set_xlim(0, max(shares) * 1.6)
    ax.set_xlabel("mean share of the squared global L2 norm (%)")
    ax.set_title(f"the {len(dom)} layers with the largest gradient norms", fontsize=10)


# ---- the text ----
def summary(run: Run, percentiles) -> list[str]:
    """Markdown lines for one run (also printed)."""
    finite = run.norm[np.isfinite(run.norm)]
    thr = run.threshold[np.isfinite(run.threshold)]
    lines = [
        f"## {run.label}",
        "",
        f"- recorded steps: {len(run.steps)} (steps {run.steps[0]}..{run.steps[-1]}), "
        f"of which {int(run.skipped.sum())} skipped and {int(run.clipped.sum())} clipped",
    ]
    if len(finite):
        lines.append(
            f"- global {_norm_type_name(run.norm_type)} norm before clipping: median {np.median(finite):.4g}, "
            f"max {finite.max():.4g}"
            + (f"; threshold in force {thr[-1]:.4g}" if len(thr) else "; no global-norm threshold in force")
        )
    lines += ["", f"Suggested thresholds for `{clip_setting(run)}`:", ""]
    lines += ["| percentile | threshold | share of recorded steps it would clip |", "|---:|---:|---:|"]
    for p, t, share in suggest(run.norm, percentiles):
        lines.append(f"| p{p:g} | {t:.4g} | {100 * share:.1f}% |")
    dom = dominant_layers(run, 8)
    if dom:
        cum = np.cumsum([d[1] for d in dominant_layers(run, len(run.layers))])
        k = int(np.searchsorted(cum, 0.8) + 1)
        lines += [
            "",
            f"Layers that dominate the norm ({k} of {len(run.layers)} make up 80% of the squared norm):",
            "",
        ]
        lines += ["| layer | share of norm² | median norm | max norm |", "|---|---:|---:|---:|"]
        lines += [f"| `{n}` | {100 * s:.1f}% | {m:.3g} | {x:.3g} |" for n, s, m, x in dom]
    bad = anomalies(run)
    if bad:
        lines += [
            "",
            "Anomalous steps:",
            "",
            "| step | skipped | non-finite values | layers with non-finite gradients |",
        ]
        lines += ["|---:|:---:|---:|---|"]
        for step, skipped, count, layers in bad:
            shown = ", ".join(f"`{n}`" for n in layers[:4]) + (
                f" (+{len(layers) - 4})" if len(layers) > 4 else ""
            )
            lines.append(f"| {step} | {'yes' if skipped else 'no'} | {count} | {shown} |")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories holding grad_stats.csv")
    ap.add_argument("--out", type=Path, help="where to write grad_report.png/.md")
    ap.add_argument("--percentiles", type=float, nargs="+", default=PERCENTILES)
    ap.add_argument("--top", type=int, default=8, help="layers shown in the bar chart")
    args = ap.parse_args(argv)
    runs = [load_run(r) for r in args.runs]
    if args.out is not None:
        out = args.out
    elif len(args.runs) == 1:
        out = args.runs[0]
    else:
        out = Path(os.path.commonpath([r.resolve() for r in args.runs]))
    out.mkdir(parents=True, exist_ok=True)
    draw(runs, out / "grad_report.png", args.top)
    lines = ["# Gradient report", "", "![gradient statistics](grad_report.png)", ""]
    for run in runs:
        lines += summary(run, args.percentiles)
    (out / "grad_report.md").write_text("\n".join(lines))
    print("\n".join(lines[4:]))
    print(f"wrote {out / 'grad_report.png'} and {out / 'grad_report.md'}")
    return 0


def run() -> None:
    """The console entry point `wapstable-grad-report`."""
    run_script(main)


if __name__ == "__main__":
    run()
