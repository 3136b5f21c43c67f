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

from wapstable.cli import run_script
from wapstable.cli.figures_data import handwriting, images, samples, save_figure, save_small, symbol_boxes
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
    return save_figure(fig, out / name)


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
