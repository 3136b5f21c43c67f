"""Benchmark the trainer's costs as ratios, side by side, in one process: prints a table, writes bench.json.

    python scripts/bench.py                          # the default config (model small, default data): minutes
    python scripts/bench.py --quick                  # debug=tiny model and data: seconds (the tests' smoke test)
    python scripts/bench.py --out bench.json model=wap trainer.device=cuda   # Hydra overrides go last
    wapstable-bench --quick                          # the same, installed

What it measures (each comparison interleaved: every repeat runs one block of each variant in turn, the order
rotated from repeat to repeat, after a warm-up repeat that is thrown away; every block of training steps starts
from the same weights and optimizer state and runs the same batches, so every variant does the same work):

1. a training step with guards off, with the default guard and clipping, with statistics, under detect_anomaly,
   each as a ratio to guards off (the ratio is the median over repeats of the ratio within a repeat);
2. stable against naive attention (`model.attention.stable`): forward and backward of the masked softmax, of one
   coverage-attention step and of the whole model, time and memory;
3. each clip mode against clip=none (guard on, statistics off);
4. the default config's samples per second at its default batch in a loop like `fit`'s, the share of that loop
   spent waiting for `stream.next()`, and the synthetic renderer's images per second in one process;
5. a skipped step (non-finite input) against a normal one, and the anomaly checkpoint and localisation that a
   real skip adds, timed apart;
6. the VGG watcher's first conv strided 2 (`model.watcher.first_stride=2`) against its first pool: the watcher's
   forward and backward, on the benchmark's batches and on a batch of the CROHME preset's size.

On CUDA it also counts host synchronisations per step in each mode (`torch.cuda.set_sync_debug_mode("warn")`).
Claims about speed live here, measured; tests only smoke-test this script (`--quick`) and never assert timings.
"""

import argparse
import copy
import json
import logging
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from wapstable.checkpoint import rng_state
from wapstable.cli import run_script
from wapstable.cli.bench_measure import STEP_MODES, Device, StepBench, compose, interleave, ratios, summary
from wapstable.cli.bench_report import machine, table, targets
from wapstable.config import CONF_DIR, TINY_OVERRIDES, register_configs
from wapstable.data.render.grammar import generate_expressions
from wapstable.data.render.mathtext import render
from wapstable.model.attention import CoverageAttention, masked_softmax
from wapstable.model.loss import forward_loss
from wapstable.stability.clip import build_clip
from wapstable.train.loop import Trainer

log = logging.getLogger("wapstable.bench")

QUICK = TINY_OVERRIDES  # the whole --quick run takes seconds even on a busy CPU

# Every option of conf/clip/ (a new clip mode's yaml joins the table), clip=none first: the others' baseline.
CLIP_MODES = tuple(
    sorted((p.stem for p in (CONF_DIR / "clip").glob("*.yaml")), key=lambda m: (m != "none", m))
)
# Every step non-finite; no checkpoint inside the step (its write is timed apart).
SKIP_MODE = [
    "stats.every=0",
    "fault=nan_input",
    "fault.step=0",
    "fault.steps=1000000000",
    "guard.checkpoint_on_anomaly=false",
]

SIZES = {  # repeats, training steps per block, target seconds per micro-benchmark block, fit loop, renders
    "quick": dict(repeats=3, steps=2, micro_s=0.005, fit_steps=4, renders=4, dense_repeats=0, dense_steps=0),
    "full": dict(repeats=15, steps=8, micro_s=0.1, fit_steps=50, renders=60, dense_repeats=9, dense_steps=3),
}


def bench_steps(sb: StepBench, repeats: int) -> dict:
    """Sections 1, 3 and 5: every step variant in one interleaved rotation, so all ratios share conditions."""
    clip_default = build_clip(sb.cfg.clip).name
    for name, overrides in STEP_MODES.items():
        sb.trainer(name, overrides)
    for mode in CLIP_MODES:
        if mode != clip_default:  # the guard trainer already runs the config's clip mode
            sb.trainer(f"clip={mode}", ["stats.every=0", f"clip={mode}"])
    sb.trainer("skipped", SKIP_MODE)
    clip_trainer = {m: sb.trainers["guard" if m == clip_default else f"clip={m}"] for m in CLIP_MODES}

    blocks = {name: sb.block(t) for name, t in sb.trainers.items()}
    blocks["bare"] = sb.block(sb.trainers["off"], sb.plain_steps)
    log.info("training steps: %d variants x %d repeats of %d steps", len(blocks), repeats, len(sb.batches))
    times = {k: [t / len(sb.batches) for t in v] for k, v in interleave(blocks, repeats).items()}

    steps = ratios({k: times[k] for k in ("off", "bare", *STEP_MODES)}, "off")
    # Statistics run every stats.every steps and cost nothing in between (capture returns at once), so the
    # default interval's cost is the every-step extra over the guard, spread over the interval. Measuring it
    # directly would need blocks of `every` steps and could not resolve 1% from the noise of a 1-in-50 step.
    every = int(compose(sb.base).stats.every) or 50
    derived = [
        (g + (s - g) / every) / o for g, s, o in zip(times["guard"], times["stats/step"], times["off"])
    ]
    steps[f"stats/{every}"] = {
        "seconds": summary([(g + (s - g) / every) for g, s in zip(times["guard"], times["stats/step"])]),
        "ratio": summary(derived),
        "derived": f"guard + (stats/step - guard) / {every}",
    }
    # The statistics' own cost: guard + statistics against the guard alone, paired per repeat.
    steps["stats overhead"] = {
        "ratio": summary([1 + (s - g) / every / g for g, s in zip(times["guard"], times["stats/step"])]),
        "derived": f"(stats/{every}) / guard",
    }
    clip_times = {m: times["guard" if m == clip_default else f"clip={m}"] for m in CLIP_MODES}
    clips = ratios(clip_times, "none")
    skip = ratios({"normal": times["guard"], "skipped": times["skipped"]}, "normal")

    samples = sum(b.images.shape[0] for b in sb.batches)
    for r in steps.values():
        if "seconds" in r:
            r["samples_per_s"] = samples / len(sb.batches) / r["seconds"]["median"]

    if sb.dev.cuda:  # after the timing, so that sync debug mode's checks cost no timed step anything
        for name in ("off", *STEP_MODES):
            steps[name]["syncs_per_step"] = sb.syncs_per_step(sb.trainers[name])
        steps["bare"]["syncs_per_step"] = sb.syncs_per_step(sb.trainers["off"], bare=True)
        for m, t in clip_trainer.items():
            clips[m]["syncs_per_step"] = sb.syncs_per_step(t)
        skip["normal"]["syncs_per_step"] = steps["guard"]["syncs_per_step"]
        skip["skipped"]["syncs_per_step"] = sb.syncs_per_step(sb.trainers["skipped"])
    return {"stats_every": every, "steps": steps, "clip": clips, "skip": skip}


def bench_guard_vs_plain(sb: StepBench, repeats: int) -> dict:
    """The trainer's guarded step (statistics off) against a plain loop with the same clipping, side by side."""
    t = sb.trainer("guard", STEP_MODES["guard"])
    blocks = {"plain + clip": sb.block(t, partial(sb.plain_steps, clip=True)), "guarded": sb.block(t)}
    times = interleave(blocks, repeats)
    out = ratios(times, "plain + clip")
    out["params_m"] = sum(p.numel() for p in t.model.parameters()) / 1e6
    out["batch"] = [list(b.images.shape) for b in sb.batches[:1]]
    if sb.dev.cuda:
        out["guarded"]["syncs_per_step"] = sb.syncs_per_step(t)
    return out


def bench_anomaly_write(sb: StepBench, repeats: int) -> dict:
    """What a real skip adds outside the step: the anomaly checkpoint, and the localisation of the first one."""
    t = sb.trainers["skipped"]
    sb.reset(t)
    batch = sb.batches[0]
    out = t.train_step(batch)
    if not out.skipped:
        raise RuntimeError(
            "fault=nan_input did not make the step non-finite; the skip timings would be wrong"
        )
    writes, path = [], None
    for _ in range(max(3, repeats // 3)):
        rng = rng_state()
        t0 = time.perf_counter()
        path = t.write_anomaly(out, batch, rng)
        writes.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    t.localize(path)
    localize_s = time.perf_counter() - t0
    return {
        "checkpoint_write_s": summary(writes),
        "checkpoint_bytes": path.stat().st_size,
        "localize_s": localize_s,
        "localized": t.localization is not None,
    }


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes the forward keeps for backward (each storage once): the activation memory a variant holds."""
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        s = x.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(storages.values())


def peak_bytes(dev: Device, fn: Callable[[], None]) -> int | None:
    """CUDA: the allocator's peak during forward and backward, above what was allocated before."""
    if not dev.cuda:
        return None
    dev.sync()
    before = torch.cuda.memory_allocated(dev.device)
    torch.cuda.reset_peak_memory_stats(dev.device)
    fn()
    dev.sync()
    return torch.cuda.max_memory_allocated(dev.device) - before


def calibrate(dev: Device, fn: Callable[[], None], target_s: float) -> int:
    """Calls per block so that a block of a micro-benchmark lasts about `target_s`."""
    fn()
    n = 1
    while True:
        t = dev.timed(partial(repeat, fn, n))
        if t >= target_s / 4 or n >= 1 << 16:
            return max(1, round(n * target_s / max(t, 1e-9)))
        n *= 4


def repeat(fn: Callable[[], object], n: int) -> None:
    for _ in range(n):
        fn()


def backward_of(forward: Callable[[bool], torch.Tensor]) -> Callable[[bool], None]:
    return lambda stable: forward(stable).backward()


def compare_stable(
    dev: Device,
    run: Callable[[bool], None],
    forward: Callable[[bool], torch.Tensor],
    repeats: int,
    calls: int,
) -> dict:
    """Stable against naive: `run(stable)` is one forward and backward, `forward(stable)` the forward alone."""

    def block(stable: bool) -> Callable[[], float]:
        return lambda: dev.timed(partial(repeat, partial(run, stable), calls)) / calls

    r = ratios(interleave({"stable": block(True), "naive": block(False)}, repeats), "naive")
    for name, stable in (("stable", True), ("naive", False)):
        r[name]["saved_bytes"] = saved_bytes(partial(forward, stable))
        r[name]["peak_bytes"] = peak_bytes(dev, partial(run, stable))
    return {"calls_per_block": calls, **r}


def attention_shape(sb: StepBench, B: int, h: int, w: int, repeats: int, micro_s: float) -> dict:
    """The masked softmax alone and one coverage-attention step, on a (h, w) feature map with padding."""
    dev, cfg = sb.dev, sb.cfg
    g = torch.Generator().manual_seed(h * 1000 + w)
    A = cfg.model.attention
    feat_dim, query_dim = sb.reference.model.parser.gru2.input_size, cfg.model.hidden_dim
    L = h * w
    mask = torch.ones(B, h, w)
    mask[B // 2 :, :, (3 * w) // 4 :] = 0  # half the batch padded: the masked positions matter
    mask = mask.to(dev.device)
    energy = torch.randn(B, L, generator=g).mul(3).to(dev.device).requires_grad_()
    att = CoverageAttention(query_dim, feat_dim, A.dim, A.coverage_channels, A.coverage_kernel)
    att = att.to(dev.device)
    query = torch.randn(B, query_dim, generator=g).to(dev.device).requires_grad_()
    feats = torch.randn(B, L, feat_dim, generator=g).to(dev.device).requires_grad_()
    proj = att.project_features(feats).detach().requires_grad_()
    coverage = torch.rand(B, h, w, generator=g).to(dev.device)

    def softmax(stable: bool) -> torch.Tensor:
        return masked_softmax(energy, mask.reshape(B, L), stable).square().sum()

    def attention(stable: bool) -> torch.Tensor:
        att.stable = stable
        context, alpha = att(query, feats, proj, mask, coverage)
        return context.square().sum() + alpha.square().sum()

    out = {}
    for kind, forward in (("softmax", softmax), ("attention step", attention)):
        run = backward_of(forward)
        calls = calibrate(dev, partial(run, True), micro_s)
        out[f"{kind} B={B} L={h}x{w}"] = compare_stable(dev, run, forward, repeats, calls)
    return out


def bench_attention(sb: StepBench, repeats: int, micro_s: float) -> dict:
    """Section 2: stable against naive masked softmax, one coverage-attention step, and the whole model."""
    out: dict[str, dict] = {}
    for h, w in ((3, 16), (8, 64)):  # a short formula's feature map; a long line's (stride 16: 128 x 1024 px)
        out.update(attention_shape(sb, 16, h, w, repeats, micro_s))

    # The whole model, forward and backward on the benchmark's batches (no optimizer: the weights stay put).
    model, precision = sb.reference.model, sb.cfg.trainer.precision
    attn = model.parser.attention
    saved = copy.deepcopy(model.state_dict())  # BatchNorm's running statistics move in forward

    def forward(stable: bool) -> torch.Tensor:
        attn.stable = stable
        return forward_loss(model, sb.batches[0], None, 0, precision)

    def run(stable: bool) -> None:
        attn.stable = stable
        model.zero_grad(set_to_none=True)
        for batch in sb.batches:
            forward_loss(model, batch, None, 0, precision).backward()

    out[f"model fwd+bwd ({len(sb.batches)} batches)"] = compare_stable(
        dev=sb.dev, run=run, forward=forward, repeats=repeats, calls=1
    )
    attn.stable = bool(sb.cfg.model.attention.stable)
    model.load_state_dict(saved)
    model.zero_grad(set_to_none=True)
    return out


def bench_data(base: list[str], tmp: Path, fit_steps: int, renders: int, dev: Device) -> dict:
    """Section 4: the default config in a loop like fit's (data wait share, samples/s) and the renderer's rate."""
    cfg = compose(base)
    cfg.run_dir = str(tmp / "default")
    t = Trainer(cfg)
    for _ in range(2):  # warm-up
        t.train_step(t.stream.next().to(t.device))
    t.go_to_step(
        0
    )  # stats.every counts from 0: the window holds the default config's share of statistics steps
    wait, total, samples = 0.0, 0.0, 0
    for _ in range(fit_steps):
        dev.sync()
        t0 = time.perf_counter()
        batch = t.stream.next().to(t.device)
        t1 = time.perf_counter()
        out = t.train_step(batch)
        if out.skipped:
            t.model.zero_grad(set_to_none=True)
        t.go_to_step(t.step + 1)
        dev.sync()
        t2 = time.perf_counter()
        wait, total, samples = wait + (t1 - t0), total + (t2 - t0), samples + batch.images.shape[0]

    d = cfg.data
    exprs = generate_expressions(renders + 2, d.seed, d.difficulty)
    fonts = list(d.fonts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one render worker runs (the renderer's own setting)
    try:
        for i in range(2):  # warm-up: the mathtext parser and the fonts load on first use
            render(exprs[i], fonts[i % len(fonts)], d.font_size, np.random.default_rng(i), d.augment)
        t0 = time.perf_counter()
        for i, tokens in enumerate(exprs[2:]):
            render(tokens, fonts[i % len(fonts)], d.font_size, np.random.default_rng(i), d.augment)
        render_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return {
        "steps": fit_steps,
        "samples_per_s": samples / total,
        "mean_batch": samples / fit_steps,
        "step_s": total / fit_steps,
        "data_wait_s": wait / fit_steps,
        "data_wait_share": wait / total,
        "num_workers": int(d.batch.num_workers),
        "render_images_per_s": renders / render_s,
        "render_workers": int(d.render_workers),
        "render_difficulty": int(d.difficulty),
    }


def bench_watcher(sb: StepBench, repeats: int) -> dict:
    """Section 6 (item 7 of docs/benchmark.md): the VGG watcher's first conv strided
    (`model.watcher.first_stride=2`) against the first pool (1): forward and backward of the watcher alone, the same
    weights, on the benchmark's batches and on a batch of CROHME's size (12 images 160 x 156 px, `experiment=crohme`'s
    300k-pixel budget). {} for another watcher."""
    from wapstable.model.watchers import build_watcher
    from wapstable.model.watchers.vgg import VGGWatcher

    reference = sb.reference.model.watcher
    if not isinstance(reference, VGGWatcher):
        return {}
    watchers = {}
    for stride in (1, 2):  # the same weights: only the first conv's stride and the pool differ
        watcher = build_watcher({**dict(sb.cfg.model.watcher), "first_stride": stride})
        watcher.load_state_dict(reference.state_dict())
        watchers[f"first_stride={stride}"] = watcher.to(sb.dev.device)
    g = torch.Generator().manual_seed(0)
    crohme = torch.rand(12, 1, 160, 156, generator=g).to(sb.dev.device)
    inputs = {
        f"the benchmark's batches ({len(sb.batches)})": [(b.images, b.image_mask) for b in sb.batches],
        "a CROHME-sized batch (12 x 160 x 156)": [(crohme, torch.ones_like(crohme[:, 0]))],
    }
    out = {}
    for label, batches in inputs.items():

        def block(watcher: torch.nn.Module, batches=batches) -> Callable[[], float]:
            def run() -> None:
                watcher.zero_grad(set_to_none=True)
                for images, mask in batches:
                    m = mask.unsqueeze(1).to(images.dtype)
                    watcher(images * m, m)[0].sum().backward()

            return partial(sb.dev.timed, run)

        out[label] = ratios(interleave({k: block(w) for k, w in watchers.items()}, repeats), "first_stride=1")
    return out


# ---- report ----
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and data, few repeats: seconds")
    p.add_argument("--out", default="bench.json", help="where the JSON goes (default: bench.json)")
    p.add_argument("--repeats", type=int, help="measured repeats of each comparison")
    p.add_argument("--steps", type=int, help="training steps per block")
    p.add_argument("--cache-dir", help="synthetic data cache (default: the config's data.cache_dir)")
    p.add_argument("--no-densewap", action="store_true", help="leave out the guard's cost on model=densewap")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the base config, e.g. model=wap")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("wapstable").setLevel(logging.ERROR)  # skips and checkpoints here are on purpose
    log.setLevel(logging.INFO)

    size = dict(SIZES["quick" if args.quick else "full"])
    size["repeats"] = args.repeats or size["repeats"]
    size["steps"] = args.steps or size["steps"]
    base = [*(QUICK if args.quick else []), "trainer.progress=false", *args.overrides]
    if args.cache_dir:
        base.append(f"data.cache_dir={args.cache_dir}")
    if size["repeats"] < 1 or size["steps"] < 1:
        p.error("--repeats and --steps must be positive")
    register_configs()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wapstable-bench-") as tmp:
        log.info("building the trainers (the first run renders the synthetic data once)")
        sb = StepBench(base, size["steps"], Path(tmp))
        res = {
            "settings": {
                "quick": args.quick,
                **size,
                "overrides": args.overrides,
                "threads": torch.get_num_threads(),
            },
            "machine": machine(sb.dev),
        }
        res.update(bench_steps(sb, size["repeats"]))
        res["guard_vs_plain"] = {"default": bench_guard_vs_plain(sb, size["repeats"])}
        if not args.quick and not args.no_densewap:
            # The guard's cost on a larger model: DenseWAP (5.4 M parameters, many BatchNorm layers), batch 8.
            log.info("guard vs plain loop on model=densewap")
            dense = StepBench(
                [*base, "model=densewap", "data.batch.max_batch=8"],
                size["dense_steps"],
                Path(tmp) / "densewap",
            )
            res["guard_vs_plain"]["densewap"] = bench_guard_vs_plain(dense, size["dense_repeats"])
        log.info("anomaly checkpoint and localisation")
        res["skip"]["anomaly"] = bench_anomaly_write(sb, size["repeats"])
        log.info("attention: stable against naive")
        res["attention"] = bench_attention(sb, size["repeats"], size["micro_s"])
        log.info("watcher: first conv strided against the first pool")
        res["watcher"] = bench_watcher(sb, size["repeats"])
        log.info("data: the default config's loop and the renderer")
        res["data"] = bench_data(base, Path(tmp), size["fit_steps"], size["renders"], sb.dev)
    res["machine"]["load_average_end"] = machine(sb.dev).get("load_average")
    res["targets"] = targets(res)
    res["wall_s"] = time.perf_counter() - t_start
    print(table(res))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"\nwritten {out} in {res['wall_s']:.0f} s")
    return 0


def run() -> None:
    """The console entry point `wapstable-bench`."""
    run_script(main)


if __name__ == "__main__":
    run()
