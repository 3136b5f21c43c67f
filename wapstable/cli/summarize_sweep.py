"""One table for a Hydra sweep: `wapstable-summarize-sweep SWEEP_DIR [--out DIR] [--no-plot]` (in a checkout:
`python scripts/summarize_sweep.py SWEEP_DIR ...`).

Each job directory (one holding `.hydra/overrides.yaml`) is a row: the overrides that differ between jobs, best
valid ExpRate, test ExpRate, skipped steps, anomalies, clip fraction, wall time. A job without `metrics.json` is a
failed row whose note is the error its log ends with; the script itself does not fail on it. A trial the Optuna
sweep's pruner stopped is a `pruned` row with its figures up to then (no test ExpRate). Prints the table and writes
`summary.csv` (raw numbers), `summary.md` and `summary.png` (ExpRate against each swept value).
"""

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

import yaml

# (column, metrics.json key, format for the printed and Markdown tables)
METRICS = [
    ("best_valid_exprate", "best_valid_exprate", "{:.2f}"),
    ("test_exprate", "test_exprate", "{:.2f}"),
    ("skipped_steps", "skipped_steps", "{:d}"),
    ("anomalies", "anomalies", "{:d}"),
    ("clip_fraction", "clip_fraction", "{:.3f}"),
    ("wall_time_s", "wall_time_s", "{:.1f}"),
]
ERROR_LINE = re.compile(r"\]\[ERROR\] - (?:(error|stopped): )?(.*)")


def find_jobs(sweep_dir: Path) -> list[Path]:
    """Job directories under `sweep_dir` (Hydra writes `.hydra/` into each), in job-number order."""
    jobs = [p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")]
    return sorted(jobs, key=lambda p: (job_number(p), str(p)))


def job_number(job: Path) -> int:
    try:
        return int(yaml.safe_load((job / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]["num"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return int(job.name) if job.name.isdigit() else sys.maxsize


def parse_overrides(job: Path) -> dict[str, str]:
    """`key=value` overrides as a dict; `+key`, `++key` and `~key` count as the key."""
    out = {}
    for item in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []:
        key, _, value = str(item).partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":  # clip='inf': quoted for Hydra
            value = value[1:-1]
        out[key.lstrip("+~")] = value
    return out


def failure_note(job: Path) -> tuple[str, str]:
    """(status, note) of a job without metrics.json, from the last ERROR line of its log."""
    logs = sorted(p for p in job.glob("*.log") if ".rank" not in p.name)
    for log in logs:
        lines = [m for m in map(ERROR_LINE.search, log.read_text(errors="replace").splitlines()) if m]
        if lines:
            kind, message = lines[-1].groups()
            return ("stopped" if kind == "stopped" else "failed"), message
    return "failed", "no metrics.json and no error in the log (crashed, killed, or still running)"


def summarize(sweep_dir: Path) -> tuple[list[str], list[dict]]:
    """The override columns that differ between jobs, and one row per job."""
    jobs = find_jobs(sweep_dir)
    overrides = {job: parse_overrides(job) for job in jobs}
    keys = list(dict.fromkeys(k for o in overrides.values() for k in o))
    swept = [k for k in keys if len({o.get(k) for o in overrides.values()}) > 1]
    rows = []
    for job in jobs:
        row = {"job": str(job.relative_to(sweep_dir)), **{k: overrides[job].get(k, "-") for k in swept}}
        metrics_path = job / "metrics.json"
        metrics = None
        if metrics_path.is_file():
            try:
                metrics = json.loads(metrics_path.read_text())
            except (OSError, ValueError) as e:
                row.update(status="failed", note=f"unreadable metrics.json ({e})")
        if metrics is None:
            if "status" not in row:
                row["status"], row["note"] = failure_note(job)
        else:
            row["status"] = (
                "preempted" if metrics.get("preempted") else "pruned" if metrics.get("pruned") else "ok"
            )
            row["note"] = f"pruned at step {metrics.get('steps')}" if metrics.get("pruned") else ""
            for column, key, _ in METRICS:
                value = metrics.get(key)
                row[column] = len(value) if isinstance(value, list) else value
        rows.append(row)
    return swept, rows


def columns(swept: list[str]) -> list[str]:
    return ["job", "status", *swept, *(c for c, _, _ in METRICS), "note"]


def cell(row: dict, column: str) -> str:
    value = row.get(column)
    if value is None:
        return "-"
    fmt = {c: f for c, _, f in METRICS}.get(column)
    if fmt and isinstance(value, int | float) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return fmt.format(int(value) if fmt == "{:d}" else value)
    number = _number(str(value)) if column not in ("job", "status", "note") else None
    if number is not None and len(str(value)) > 8:  # Optuna's draws: 0.3786187886542605 -> 0.3786
        return f"{number:.4g}"
    return str(value)


def text_table(swept: list[str], rows: list[dict]) -> str:
    cols = columns(swept)
    cells = [cols, *([cell(r, c) for c in cols] for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(swept: list[str], rows: list[dict]) -> str:
    cols = columns(swept)

    def md(v: str) -> str:
        return v.replace("|", "\\|")

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(md(cell(r, c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, swept: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(swept), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns(swept)})


def _number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def plot(path: Path, swept: list[str], rows: list[dict]) -> None:
    """ExpRate against each swept value (one panel per key); failed jobs as red crosses on the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept or ["job"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        values = [str(r.get(key, "-")) for r in rows]
        numbers = [_number(v) for v in values]
        numeric = all(n is not None for n in numbers)
        if numeric:
            xs = numbers
            if min(xs) > 0 and max(xs) / min(xs) >= 20:  # learning rates, thresholds: a log axis
                ax.set_xscale("log")
        else:  # clip modes and other names: one slot each, in order of appearance
            names = list(dict.fromkeys(values))
            xs = [names.index(v) for v in values]
            ax.set_xticks(range(len(names)), names, rotation=30 if len(names) > 4 else 0)
        ok = [
            (x, r)
            for x, r in zip(xs, rows)
            if r["status"] not in ("failed", "pruned") and r.get("best_valid_exprate") is not None
        ]
        pruned = [(x, r["best_valid_exprate"]) for x, r in zip(xs, rows) if r["status"] == "pruned"]
        failed = [
            x for x, r in zip(xs, rows) if r["status"] == "failed" or r.get("best_valid_exprate") is None
        ]
        if ok:
            ax.scatter([x for x, _ in ok], [r["best_valid_exprate"] for _, r in ok], label="best valid")
            test = [(x, r["test_exprate"]) for x, r in ok if r.get("test_exprate") is not None]
            if test:
                ax.scatter(*zip(*test), marker="^", label="test")
        if pruned:
            ax.scatter(*zip(*pruned), marker="v", color="grey", label="pruned (valid so far)")
        if failed:
            ax.scatter(failed, [0.0] * len(failed), marker="x", color="red", label="failed")
        top = max(
            [r.get("best_valid_exprate") or 0 for r in rows] + [r.get("test_exprate") or 0 for r in rows]
        )
        ax.set_ylim(-3, max(5.0, min(100.0, top * 1.15)) + 3)  # ExpRate is a percentage; 0 stays in view
        ax.set_xlabel(key)
        ax.set_ylabel("ExpRate (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="the sweep directory (hydra.sweep.dir)")
    parser.add_argument(
        "--out", type=Path, help="where summary.csv/.md/.png go (default: the sweep directory)"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip summary.png")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(
            f"error: {args.sweep_dir} is not a folder; give the sweep directory (hydra.sweep.dir)",
            file=sys.stderr,
        )
        return 2
    swept, rows = summarize(args.sweep_dir)
    if not rows:
        print(
            f"error: no job directory (one holding .hydra/overrides.yaml) under {args.sweep_dir}; "
            "is it a sweep directory of `python train.py -m ...`?",
            file=sys.stderr,
        )
        return 2
    out = args.out or args.sweep_dir
    out.mkdir(parents=True, exist_ok=True)
    table = text_table(swept, rows)
    best = args.sweep_dir / "optimization_results.yaml"  # an Optuna sweep's verdict
    footer = ""
    if best.is_file():
        result = yaml.safe_load(best.read_text()) or {}
        footer = f"Optuna best: {result.get('best_params')} -> {result.get('best_value')}"
        if result.get("trials"):  # this sweep's trials by how they ended
            footer += " (trials: " + ", ".join(f"{n} {state}" for state, n in result["trials"].items()) + ")"
    n_failed = sum(r["status"] in ("failed", "stopped") for r in rows)
    n_pruned = sum(r["status"] == "pruned" for r in rows)
    print(table)
    counts = f"{len(rows)} jobs, {n_failed} failed or stopped" + (f", {n_pruned} pruned" if n_pruned else "")
    print(f"\n{counts}" + (f"\n{footer}" if footer else ""))
    write_csv(out / "summary.csv", swept, rows)
    (out / "summary.md").write_text(markdown_table(swept, rows) + (f"\n\n{footer}\n" if footer else "\n"))
    written = ["summary.csv", "summary.md"]
    if not args.no_plot:
        plot(out / "summary.png", swept, rows)
        written.append("summary.png")
    print(f"wrote {', '.join(str(out / w) for w in written)}")
    return 0


def run() -> None:
    """The console entry point `wapstable-summarize-sweep`."""
    sys.exit(main())


if __name__ == "__main__":
    run()
