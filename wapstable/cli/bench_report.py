"""The table and figures `scripts/bench.py` prints and writes (bench.json): the ratios with their spread, the
machine, and the targets each ratio is reported against (never asserted)."""

import contextlib
import os
import platform
from pathlib import Path

import torch

from wapstable.cli.bench_measure import Device

TARGETS = {  # upper bounds, reported and never asserted
    "guard vs guards off": 1.02,
    "guard vs plain loop": 1.01,  # the same clipping by hand: what the guard's decisions cost
    "statistics vs guard": 1.01,
    "stable vs naive attention": 1.0,
    # With data.batch.num_workers=0 loading is in series with the step: under 5% it is not what limits a run.
    "data wait share": 0.05,
}


def machine(dev: Device) -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):  # the CPU's marketing name, where Linux gives it
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(dev.device),
    }
    if dev.cuda:
        info["gpu"] = torch.cuda.get_device_name(dev.device)
    if hasattr(os, "getloadavg"):  # a busy machine makes every absolute figure, and some ratios, unreliable
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def fmt_ratio(r: dict) -> str:
    s = r["ratio"]
    return f"{s['median']:.3f}x [{s['q1']:.3f}, {s['q3']:.3f}]"


def fmt_ms(r: dict) -> str:
    s = r["seconds"]
    return f"{s['median'] * 1e3:.3f} ms [{s['q1'] * 1e3:.3f}, {s['q3'] * 1e3:.3f}]"


def fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def fmt_syncs(r: dict) -> str:
    v = r.get("syncs_per_step")
    return "-" if v is None else f"{v:g}"


def table(res: dict) -> str:
    """Markdown tables (ready for the README): medians with the interquartile range in brackets."""
    m, settings, every = res["machine"], res["settings"], res["stats_every"]
    gpu = f" ({m['gpu']})" if "gpu" in m else ""
    lines = [
        f"wapstable bench ({'quick' if settings['quick'] else 'full'}): {m['cpu']}, {m['cores']} cores, "
        f"torch {m['torch']} on {m['device']}{gpu}, "
        f"{settings['repeats']} repeats of {settings['steps']} steps; load average {m.get('load_average', '?')}",
        "",
        "| training step | time per step | vs guards off | samples/s | host syncs/step |",
        "|---|---|---|---|---|",
    ]
    labels = {
        "bare": "bare loop (no trainer)",
        "off": "guards off",
        "guard": "default guard + clipping",
        f"stats/{every}": f"guard + statistics (every {every}, derived)",
        "stats/step": "guard + statistics every step",
        "anomaly": "guard + detect_anomaly",
    }
    for k, label in labels.items():
        r = res["steps"][k]
        lines.append(
            f"| {label} | {fmt_ms(r)} | {fmt_ratio(r)} | {r['samples_per_s']:.1f} | {fmt_syncs(r)} |"
        )
    r = res["steps"]["stats overhead"]
    lines.append(f"| statistics alone (every {every}, derived) | | {fmt_ratio(r)} of the guard's | | |")

    lines += [
        "",
        "| guard against a plain loop with the same clipping | plain + clip | guarded | guarded vs plain |",
        "|---|---|---|---|",
    ]
    for k, r in res["guard_vs_plain"].items():
        lines.append(
            f"| {k} ({r['params_m']:.2f} M parameters, batch {r['batch'][0][0]}) | {fmt_ms(r['plain + clip'])} "
            f"| {fmt_ms(r['guarded'])} | {fmt_ratio(r['guarded'])} |"
        )
    lines += ["", "| clip mode | time per step | vs clip=none | host syncs/step |", "|---|---|---|---|"]
    for k, r in res["clip"].items():
        lines.append(f"| {k} | {fmt_ms(r)} | {fmt_ratio(r)} | {fmt_syncs(r)} |")

    skip = res["skip"]
    lines += ["", "| step | time | vs normal step | host syncs/step |", "|---|---|---|---|"]
    for k in ("normal", "skipped"):
        lines.append(f"| {k} | {fmt_ms(skip[k])} | {fmt_ratio(skip[k])} | {fmt_syncs(skip[k])} |")
    a = skip["anomaly"]
    lines.append(
        f"| + anomaly checkpoint write | {a['checkpoint_write_s']['median'] * 1e3:.1f} ms "
        f"({fmt_bytes(a['checkpoint_bytes'])}) | | |"
    )
    lines.append(f"| + localisation (first skip only) | {a['localize_s'] * 1e3:.1f} ms | | |")

    lines += [
        "",
        "| attention, forward + backward | stable | naive | stable vs naive | saved for backward (stable / naive) "
        "| CUDA peak (stable / naive) |",
        "|---|---|---|---|---|---|",
    ]
    for k, r in res["attention"].items():
        s, n = r["stable"], r["naive"]
        lines.append(
            f"| {k} | {fmt_ms(s)} | {fmt_ms(n)} | {fmt_ratio(s)} | "
            f"{fmt_bytes(s['saved_bytes'])} / {fmt_bytes(n['saved_bytes'])} | "
            f"{fmt_bytes(s['peak_bytes'])} / {fmt_bytes(n['peak_bytes'])} |"
        )

    if res.get("watcher"):
        lines += [
            "",
            "| watcher, forward + backward | first_stride=1 | first_stride=2 | 2 vs 1 |",
            "|---|---|---|---|",
        ]
        for k, r in res["watcher"].items():
            one, two = r["first_stride=1"], r["first_stride=2"]
            lines.append(f"| {k} | {fmt_ms(one)} | {fmt_ms(two)} | {fmt_ratio(two)} |")

    d = res["data"]
    lines += [
        "",
        "| data | |",
        "|---|---|",
        f"| default config, fit-like loop ({d['steps']} steps) | {d['samples_per_s']:.1f} samples/s "
        f"(mean batch {d['mean_batch']:.1f}, {d['step_s'] * 1e3:.1f} ms/step) |",
        f"| waiting for data (num_workers={d['num_workers']}) | {d['data_wait_share'] * 100:.2f}% of the step "
        f"({d['data_wait_s'] * 1e3:.2f} ms) |",
        f"| rendering, one process (difficulty {d['render_difficulty']}) | {d['render_images_per_s']:.1f} images/s |",
        "",
        "| target (reported, not asserted) | value | |",
        "|---|---|---|",
    ]
    for k, t in res["targets"].items():
        lines.append(f"| {k} <= {t['target']:g} | {t['value']:.3f} | {'met' if t['met'] else 'MISSED'} |")
    return "\n".join(lines)


def targets(res: dict) -> dict:
    """The issue's targets against the medians; stable vs naive takes the worst of its rows."""
    values = {
        "guard vs guards off": res["steps"]["guard"]["ratio"]["median"],
        "statistics vs guard": res["steps"]["stats overhead"]["ratio"]["median"],
        "stable vs naive attention": max(r["stable"]["ratio"]["median"] for r in res["attention"].values()),
        "data wait share": res["data"]["data_wait_share"],
        **{
            f"guard vs plain loop ({k})": r["guarded"]["ratio"]["median"]
            for k, r in res["guard_vs_plain"].items()
        },
    }
    return {
        k: {"target": TARGETS[k.split(" (")[0]], "value": v, "met": v <= TARGETS[k.split(" (")[0]]}
        for k, v in values.items()
    }
