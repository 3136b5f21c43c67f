"""Draw the documentation's pictures into docs/: `wapstable-figures [--run RUN_DIR] [--checkpoint CKPT] [--out docs]`.

    make figures ARGS="--run outputs/default-run --checkpoint outputs/long/checkpoints/best.pt"
    python scripts/figures.py --only samples sweep          # in a checkout, the same as wapstable-figures

Each picture comes from the project's own tools, so it shows what a user of them sees:

    samples.png            rendered training samples and their LaTeX (wapstable.data.render, as data=synthetic)
    symbol-boxes.png       the box of each token's symbol over rendered samples (the attention guide's targets)
    handwriting.png        rendered handwriting (data.style=handwritten) with its boxes; --crohme: real ink beside
    images.png             images from elsewhere before and after data/normalize.py brings them to the model's ink:
                           a WAP-authors-like bitmap (--wap DIR and --crohme: the real one and the same expression's
                           InkML), a dark-on-light scan-like image and the project's own raster
    grad-report-fault.png  scripts/grad_report.py on a tiny run fed a NaN batch at step 5 (fault=nan_input)
    sweep-summary.png      scripts/summarize_sweep.py on a tiny grid sweep: clip modes, without and with an lr spike
    exprate-curve.png      valid ExpRate and token error rate over the steps of --run (its metrics.json)
    attention-*.png        scripts/predict.py --attention with --checkpoint on a rendered fraction and scripts
    crohme-curve.png       with --crohme-run (a finished experiment=crohme run) and --crohme (a CROHME test folder):
    grad-report-crohme.png its ExpRate curve, its gradient report, and its best.pt reading a test file of --crohme
    attention-crohme.png   (518_em_417.inkml where the folder has it) with predict.py --attention

The first three train what they need in a temporary folder (`--work` keeps it): seconds to a few minutes on a
CPU. The last two need a finished run and a trained checkpoint and are skipped, with a line saying so, when
`--run` / `--checkpoint` are not given. Pictures are saved with a palette of at most 256 colours, so the set stays
a few hundred KB in git. Exit code 2: a --run without metrics.json, a --checkpoint that is not one, a tiny run
that fails.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from wapstable.cli import run_script
from wapstable.errors import UserError

FIGURES = ("samples", "boxes", "handwriting", "images", "grad", "sweep", "exprate", "attention", "crohme")
# The tiny runs: debug=tiny (conf/debug/tiny.yaml) without loggers or progress bars.
TINY = ["debug=tiny", "logger=[]", "trainer.progress=false"]
FAULT_RUN = "nan_input-at-step-5"  # the run directory's name is the gradient report's title
# Every clip mode, without and with an lr spike (x1e20 at step 5): the guard stops the spiked jobs (exit 3), and
# the sweep goes on. 20 steps are too few to read anything, so every ExpRate is 0: the picture shows the layout.
SWEEP = ["clip=none,norm,inf", "fault=none,lr_spike"]
# The expressions of the attention pictures (the README's `render.py` examples): a fraction, and scripts.
ATTENTION = [("fraction", r"\frac{a+1}{b}"), ("script", "x^{2}+y_{i}")]


def save_small(src: Path, dst: Path) -> None:
    """Copy the PNG `src` to `dst` with an adaptive palette: plots have few colours, so this loses nothing visible
    and makes the file several times smaller."""
    from PIL import Image

    with Image.open(src) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    dst.parent.mkdir(parents=True, exist_ok=True)
    small.save(dst, optimize=True)


def train(args: list[str], work: Path, what: str, multirun: bool = False) -> Path:
    """Run `wapstable-train [-m] ARGS` in a subprocess under `work`; returns its log. A failed run is a UserError
    naming the log; a sweep's status is left to its summary (a stopped job makes Hydra exit 1, as intended)."""
    cmd = [sys.executable, "-m", "wapstable.cli.train", *(["-m"] if multirun else []), *TINY, *args]
    log = work / f"{what.replace(' ', '-')}.log"
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=work, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0 and not multirun:
        raise UserError(f"the {what} failed (exit status {code}); its output is in {log}")
    return log


# ---- the pictures ----
def samples(out: Path, n: int = 12, seed: int = 0) -> Path:
    """A grid of `n` rendered training expressions (default data config) with their token strings."""
    from matplotlib.figure import Figure
    from omegaconf import OmegaConf

    from wapstable.config import CONF_DIR
    from wapstable.data.render.grammar import generate_expressions
    from wapstable.data.render.mathtext import FONTS, render

    data = OmegaConf.load(CONF_DIR / "data" / "synthetic.yaml")
    exprs = generate_expressions(n, seed, int(data.difficulty))
    images = []
    for i, tokens in enumerate(exprs):
        rng = np.random.default_rng([seed, i])  # each image its own stream; the fonts in turn, so all show
        images.append(render(tokens, FONTS[i % len(FONTS)], int(data.font_size), rng, bool(data.augment)))
    ncols = 3
    nrows = -(-n // ncols)
    fig = Figure(figsize=(4.2 * ncols, 1.55 * nrows + 0.6), dpi=100)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    width = max(im.shape[1] for im in images)
    for ax, im, tokens, i in zip(axes, images, exprs, range(n)):
        ax.imshow(255 - im, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_xlim(-0.5, width - 0.5)  # one pixel scale for every panel: small expressions stay small
        ax.set_title(" ".join(tokens).replace("$", r"\$"), fontsize=7, family="monospace")
        ax.set_xlabel(f"font {FONTS[i % len(FONTS)]}", fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.spines[:].set_visible(False)
    for ax in axes[n:]:
        ax.axis("off")
    fig.suptitle(
        f"data=synthetic: {data.font_size} pt mathtext, augmented, difficulty {data.difficulty} "
        "(title: the label the parser learns)",
        fontsize=10,
    )
    fig.tight_layout()
    return _save(fig, out / "samples.png")


def symbol_boxes(out: Path, n: int = 6, seed: int = 1, crohme: Path | None = None) -> Path:
    """Rendered training expressions (default data config, augmented) with the box of every token's symbol, as the
    attention guide (model.attention.guide) reads them: each box is labelled with its token; tokens without ink of
    their own ({, }, ^, _) have none. With `crohme` (a folder of InkML), also the first 4 of its files whose
    traceGroups give boxes, rasterised as data=crohme does."""
    from omegaconf import OmegaConf

    from wapstable.config import CONF_DIR
    from wapstable.data.render.grammar import generate_expressions
    from wapstable.data.render.mathtext import FONTS, render_boxes

    data = OmegaConf.load(CONF_DIR / "data" / "synthetic.yaml")
    panels = []  # (image, boxes, tokens, caption)
    for i, tokens in enumerate(generate_expressions(n, seed, int(data.difficulty))):
        rng = np.random.default_rng([seed, i])
        font = FONTS[i % len(FONTS)]
        image, boxes = render_boxes(tokens, font, int(data.font_size), rng, bool(data.augment))
        panels.append((image, boxes, tokens, f"rendered, font {font}"))
    if crohme is not None:
        panels += _crohme_panels(Path(crohme), 4)
    title = (
        "where each token is: the renderer's glyph and rule boxes, bent with the image by the augmentation"
        + (", and CROHME's traceGroups" if crohme is not None else "")
        + " ({ } ^ _ have no box)"
    )
    return _box_figure(panels, n, title, out / "symbol-boxes.png")


def handwriting(out: Path, n: int = 8, seed: int = 2, crohme: Path | None = None) -> Path:
    """Rendered handwriting as experiment=handwritten draws it (data.style=handwritten, data.symbols=crohme and its
    data.frequencies), with each token's box; with `crohme` (a folder of InkML), real CROHME files beside them,
    rasterised alike."""
    from omegaconf import OmegaConf

    from wapstable.config import CONF_DIR, DataConfig
    from wapstable.data.ink.raster import Raster
    from wapstable.data.render.grammar import generate_expressions
    from wapstable.data.render.handwritten import render_handwritten
    from wapstable.data.render.mathtext import FONTS

    data = OmegaConf.merge(
        OmegaConf.structured(DataConfig),
        OmegaConf.load(CONF_DIR / "data" / "synthetic.yaml"),
        OmegaConf.load(CONF_DIR / "experiment" / "handwritten.yaml").data,
    )
    raster = Raster.of(data)
    # the glyphs as far from the fonts as the preset draws them
    style = {key: float(data[key]) for key in ("jitter", "distort", "allographs")}
    panels = []
    for i, tokens in enumerate(
        generate_expressions(n, seed, int(data.difficulty), "crohme", str(data.frequencies))
    ):
        rng = np.random.default_rng([seed, i])
        image, boxes = render_handwritten(
            tokens, FONTS[i % len(FONTS)], int(data.font_size), rng, raster, **style
        )
        panels.append((image, boxes, tokens, "rendered handwriting (data.style=handwritten)"))
    if crohme is not None:
        from wapstable.data.ink.bank import bank_path, load_bank

        # the same layouts with real symbols cut from the folder's traceGroups (data.glyphs=crohme)
        bank = load_bank(str(bank_path(Path(crohme), float(data.valid_fraction), data.cache_dir)))
        for i, tokens in enumerate(
            generate_expressions(4, seed + 1, int(data.difficulty), "crohme", str(data.frequencies))
        ):
            rng = np.random.default_rng([seed + 1, i])
            image, boxes = render_handwritten(tokens, "cm", int(data.font_size), rng, raster, 1.0, bank)
            panels.append((image, boxes, tokens, "real symbols in a rendered layout (data.glyphs=crohme)"))
        panels += _crohme_panels(Path(crohme), 4, raster)
    title = (
        "experiment=handwritten's training images: mathtext's layout drawn as jittered stroke-font glyphs"
        + (
            "; the same with real symbols cut from CROHME files; real CROHME ink"
            if crohme is not None
            else ""
        )
    )
    return _box_figure(panels, n, title, out / "handwriting.png")


def images(out: Path, wap: Path | None = None, crohme: Path | None = None, ink=None) -> Path:
    """One expression three ways, before and after normalisation to `ink` (a checkpoint's InkStats, else
    data.ink_stroke / data.ink_symbol): a WAP bitmap (from `wap`, the WAP authors' off_image_test folder, with
    `crohme` its InkML folder; else the raster drawn as theirs are, a 4-px pen 1.3 times as large), a scan-like
    image (dark ink on grey paper, blurred, noisy, twice as large) and the project's own raster."""
    import matplotlib.pyplot as plt
    from PIL import Image
    from scipy import ndimage as ndi

    from wapstable.data.ink.raster import Raster
    from wapstable.data.ink.read import read_inkml
    from wapstable.data.normalize import InkStats, normalize

    ink = ink or InkStats(2.3, 31.0)
    raster = Raster(160, 2, 24.0)
    if wap is not None and crohme is not None:
        key = next(
            (
                f.stem[:-2]
                for f in sorted(Path(wap).glob("*_0.bmp"))
                if (Path(crohme) / f"{f.stem[:-2]}.inkml").is_file()
            ),
            None,
        )
        if key is None:
            raise UserError(
                f"--wap {wap} and --crohme {crohme} share no expression; give the 2014 test folders"
            )
        own = read_inkml(Path(crohme) / f"{key}.inkml", raster).image
        theirs = np.asarray(Image.open(Path(wap) / f"{key}_0.bmp").convert("L"))
        source = f"the WAP authors' bitmap of {key}"
    else:
        from wapstable.data.ink.raster import rasterize_traces

        strokes = [np.array([[0, 0], [20, 30]]), np.array([[20, 0], [0, 30]]), np.array([[30, 15], [50, 15]])]
        strokes += [np.array([[40, 5], [40, 25]]), np.array([[60, 0], [70, 5], [60, 30], [75, 30]])]
        own = rasterize_traces(strokes, raster.height, raster.line_width, symbol_size=raster.symbol_size)
        big = ndi.binary_dilation(own > 127, np.ones((3, 3), bool)).astype(np.uint8) * 255
        theirs = np.asarray(
            Image.fromarray(big).resize((round(big.shape[1] * 1.3), round(big.shape[0] * 1.3)))
        )
        source = "a WAP-like bitmap (4-px pen, 1.3x)"
    scan = np.asarray(Image.fromarray(own).resize((own.shape[1] * 2, own.shape[0] * 2)), np.float32)
    scan = ndi.gaussian_filter(215 - scan * 0.65, 1.2) + np.random.default_rng(0).normal(0, 6, scan.shape)
    scan = scan.clip(0, 255).astype(np.uint8)
    rows = [
        (source, theirs),
        ("a scan: dark ink on grey paper, blurred, 2x", scan),
        ("the project's raster", own),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(10, 6.5))
    for (name, image), (left, right) in zip(rows, axes):
        after = normalize(image, ink)
        for ax, im, what in ((left, image, f"{name}: as read"), (right, after, "normalised")):
            ax.imshow(im, cmap="gray", vmin=0, vmax=255)
            ax.set_title(f"{what} ({im.shape[0]}x{im.shape[1]} px)", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(
        f"Images brought to the model's ink ({ink.stroke_width:.2f}-px pen, symbols {ink.symbol_size:.0f} px)"
    )
    fig.tight_layout()
    return _save(fig, out / "images.png")


def _box_figure(panels: list[tuple], n: int, title: str, path: Path) -> Path:
    """Panels (image, boxes, tokens, caption) in two columns, each token's box drawn and labelled."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    ncols = 2
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(6.4 * ncols, 2.1 * nrows + 0.5), dpi=100)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    width = max(im.shape[1] for im, *_ in panels[:n])
    colours = [f"C{k}" for k in range(10)]
    for ax, (im, boxes, tokens, caption) in zip(axes, panels):
        ax.imshow(255 - im, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        k = 0
        for tok, box in zip(tokens, boxes):
            if not np.isfinite(box).all():
                continue
            x0, y0, x1, y1 = (float(v) for v in box)
            colour = colours[k % len(colours)]
            k += 1
            ax.add_patch(Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0, y1 - y0, fill=False, lw=1.0, ec=colour))
            ax.text(x0 - 0.5, y0 - 1, tok, color=colour, fontsize=6, family="monospace", va="bottom")
        ax.set_xlim(-0.5, max(width, im.shape[1]) - 0.5)
        ax.set_ylim(im.shape[0] - 0.5, -6)
        ax.set_title(" ".join(tokens).replace("$", r"\$"), fontsize=7, family="monospace")
        ax.set_xlabel(caption, fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.spines[:].set_visible(False)
    for ax in axes[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _crohme_panels(folder: Path, count: int, raster=None) -> list[tuple]:
    """The first `count` InkML files under `folder` (4 to 20 tokens) whose traceGroups give boxes, rasterised by
    `raster` (default: data=crohme's)."""
    from omegaconf import OmegaConf

    from wapstable.config import CONF_DIR, DataConfig
    from wapstable.data.ink.raster import Raster
    from wapstable.data.ink.read import read_inkml
    from wapstable.data.latex import DataError

    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(CONF_DIR / "data" / "crohme.yaml"))
    raster = raster or Raster.of(cfg)
    panels = []
    for path in sorted(folder.rglob("*.inkml")):
        try:
            s = read_inkml(path, raster)
        except DataError:
            continue
        if s.boxes is not None and 4 <= len(s.tokens) <= 20:
            panels.append((s.image, s.boxes, s.tokens, f"CROHME {path.name}"))
        if len(panels) == count:
            break
    if not panels:
        raise UserError(f"--crohme {folder}: no InkML file there has traceGroups that match its label")
    return panels


def grad_report(out: Path, work: Path) -> Path:
    """The gradient report of a tiny run whose step-5 batch holds a NaN pixel."""
    from wapstable.cli import grad_report as report

    run = work / FAULT_RUN
    train(["fault=nan_input", "fault.step=5", "stats.every=1", f"hydra.run.dir={run}"], work, "fault run")
    report.main([str(run), "--out", str(work / "grad")])
    save_small(work / "grad" / "grad_report.png", out / "grad-report-fault.png")
    return out / "grad-report-fault.png"


def sweep(out: Path, work: Path) -> Path:
    """The summary plot of a tiny basic-launcher grid sweep."""
    from wapstable.cli import summarize_sweep

    sweep_dir = work / "sweep"
    log = train([*SWEEP, f"hydra.sweep.dir={sweep_dir}"], work, "tiny sweep", multirun=True)
    if summarize_sweep.main([str(sweep_dir), "--out", str(work / "summary")]) != 0:
        raise UserError(f"the tiny sweep ran no job; its output is in {log}")
    save_small(work / "summary" / "summary.png", out / "sweep-summary.png")
    return out / "sweep-summary.png"


def exprate_curve(out: Path, run: Path, name: str = "exprate-curve.png") -> Path:
    """Valid ExpRate and token error rate at each evaluation of `run`, with its test ExpRate."""
    from matplotlib.figure import Figure

    metrics_path = run / "metrics.json"
    try:
        metrics = json.loads(metrics_path.read_text())
        evals = metrics["evals"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"{metrics_path} is missing or unreadable; give --run the directory of a finished run"
        ) from None
    if not evals:
        raise UserError(f"{metrics_path} holds no evaluation; train with trainer.eval_every below its steps")
    steps = [e["step"] for e in evals]
    fig = Figure(figsize=(6.4, 3.8), dpi=100)
    ax = fig.subplots()
    ax.plot(steps, [e["exprate"] for e in evals], "o-", color="tab:blue", label="valid ExpRate")
    ax.plot(steps, [e["wer"] for e in evals], "s--", color="tab:gray", label="valid token error rate")
    if metrics.get("test_exprate") is not None:  # drawn at the step of the checkpoint it was measured with
        test, best = metrics["test_exprate"], metrics.get("best_step") or steps[-1]
        label = f"test ExpRate of the best checkpoint: {test:.1f} %"
        ax.plot([best], [test], "*", ms=13, color="tab:red", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("%")
    ax.set_ylim(-2, max(100, *(e["wer"] for e in evals)) + 3)  # an untrained model's WER passes 100 %
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    minutes = metrics.get("wall_time_s", 0) / 60
    ax.set_title(
        f"{run.resolve().name}: {metrics.get('steps', steps[-1])} steps, {minutes:.1f} min", fontsize=10
    )
    fig.tight_layout()
    return _save(fig, out / name)


def attention(out: Path, work: Path, checkpoint: Path, cfg) -> list[Path]:
    """predict.py --attention on the ATTENTION expressions, rendered at the size `cfg` (the checkpoint's config)
    trained on."""
    from wapstable.cli import predict, render

    size = int(cfg.data.font_size) if cfg.data.name == "synthetic" else 28
    images = []
    for name, latex in ATTENTION:
        images.append(str(work / f"{name}.png"))
        render.main([latex, images[-1], "--font-size", str(size)])
    predict.main([str(checkpoint), *images, "--attention", str(work / "att.png")])
    written = []
    for n, (name, _) in enumerate(ATTENTION, 1):
        written.append(out / f"attention-{name}.png")
        save_small(predict.attention_path(work / "att.png", n, len(ATTENTION)), written[-1])
    return written


# The 2014 test expression of the CROHME attention picture, when the --crohme folder holds it.
CROHME_EXAMPLE = "518_em_417.inkml"


def crohme_run(out: Path, work: Path, run: Path, folder: Path | None) -> list[Path]:
    """A finished experiment=crohme run: its ExpRate curve, its gradient report, and its best.pt's attention over
    one test file of `folder` rasterised as the run's data config draws it."""
    from wapstable.cli import grad_report as report
    from wapstable.cli import predict, render
    from wapstable.eval.evaluation import load_model

    written = [exprate_curve(out, run, "crohme-curve.png")]
    if report.main([str(run), "--out", str(work / "grad-crohme")]) != 0:
        raise UserError(f"{run} holds no grad_stats.csv; give --crohme-run a finished training run")
    save_small(work / "grad-crohme" / "grad_report.png", out / "grad-report-crohme.png")
    written.append(out / "grad-report-crohme.png")
    if folder is None:
        print("attention-crohme.png skipped: give --crohme a CROHME test folder (e.g. DIR/TestEM2014GT)")
        return written
    files = sorted(folder.rglob("*.inkml"))
    if not files:
        raise UserError(f"--crohme {folder} holds no .inkml file; give a CROHME test folder")
    example = next((f for f in files if f.name == CROHME_EXAMPLE), files[0])
    checkpoint = run / "checkpoints" / "best.pt"
    _, _, cfg = load_model(str(checkpoint), "cpu")
    image = work / "crohme.png"
    size = ["--symbol-size", str(cfg.data.symbol_size), "--height", str(cfg.data.height)]
    render.main([str(example), str(image), *size])
    predict.main([str(checkpoint), str(image), "--attention", str(work / "att-crohme.png")])
    save_small(work / "att-crohme.png", out / "attention-crohme.png")
    return [*written, out / "attention-crohme.png"]


def _save(fig, path: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        fig.savefig(Path(tmp) / "full.png")
        save_small(Path(tmp) / "full.png", path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs"), help="where the PNGs go (default: docs)")
    p.add_argument("--run", type=Path, help="a finished run directory, for exprate-curve.png")
    p.add_argument("--checkpoint", type=Path, help="a trained checkpoint, for attention-*.png")
    p.add_argument("--work", type=Path, help="keep the tiny runs here (default: a temporary folder)")
    p.add_argument(
        "--crohme", type=Path, help="a folder of CROHME InkML: symbol-boxes.png shows 4 of its files"
    )
    p.add_argument(
        "--wap", type=Path, help="the WAP authors' off_image_test folder, for images.png (with --crohme)"
    )
    p.add_argument(
        "--crohme-run",
        type=Path,
        help="a finished experiment=crohme run, for crohme-curve.png, grad-report-crohme.png, attention-crohme.png",
    )
    p.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES), help="draw only these")
    args = p.parse_args(argv)
    # Bad arguments fail before anything is trained or drawn.
    if args.run is not None and not (args.run / "metrics.json").is_file():
        raise UserError(f"--run {args.run} holds no metrics.json; give the directory of a finished run")
    if args.checkpoint is not None:
        from wapstable.eval.evaluation import load_model

        if not args.checkpoint.is_file():
            raise UserError(
                f"--checkpoint {args.checkpoint} is not a file; give a checkpoint such as best.pt"
            )
        _, _, ckpt_cfg = load_model(str(args.checkpoint), "cpu")  # not a checkpoint: a UserError naming it
    if args.crohme_run is not None:
        for need in ("metrics.json", "checkpoints/best.pt"):
            if not (args.crohme_run / need).is_file():
                raise UserError(
                    f"--crohme-run {args.crohme_run} holds no {need}; give the directory of a finished "
                    "experiment=crohme run"
                )
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="wapstable-figures-"))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    written, done = [], False
    try:
        if "samples" in args.only:
            written.append(samples(args.out))
        if "boxes" in args.only:
            written.append(symbol_boxes(args.out, crohme=args.crohme))
        if "handwriting" in args.only:
            written.append(handwriting(args.out, crohme=args.crohme))
        if "images" in args.only:
            stats = None
            if args.checkpoint is not None:
                from wapstable.eval.evaluation import load_model

                stats = load_model(str(args.checkpoint), "cpu")[0].ink_stats
            written.append(images(args.out, args.wap, args.crohme, stats))
        if "grad" in args.only:
            written.append(grad_report(args.out, work))
        if "sweep" in args.only:
            written.append(sweep(args.out, work))
        if "exprate" in args.only:
            if args.run is None:
                print("exprate-curve.png skipped: give --run RUN_DIR (a finished run, e.g. of `make train`)")
            else:
                written.append(exprate_curve(args.out, args.run))
        if "attention" in args.only:
            if args.checkpoint is None:
                print("attention-*.png skipped: give --checkpoint CKPT (a trained model's best.pt)")
            else:
                written += attention(args.out, work, args.checkpoint, ckpt_cfg)
        if "crohme" in args.only:
            if args.crohme_run is None:
                print("crohme-*.png skipped: give --crohme-run RUN_DIR (a finished experiment=crohme run)")
            else:
                written += crohme_run(args.out, work, args.crohme_run, args.crohme)
        done = True
    finally:
        if args.work is None and done:  # after a failure the folder stays: the error names a log in it
            shutil.rmtree(work, ignore_errors=True)
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")
    return 0


def run() -> None:
    """The console entry point `wapstable-figures`."""
    run_script(main)


if __name__ == "__main__":
    run()
