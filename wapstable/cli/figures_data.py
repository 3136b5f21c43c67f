"""The documentation's pictures of data (`make figures`; wapstable/cli/figures.py lists them): rendered samples,
their symbol boxes, rendered and real handwriting, and images from elsewhere brought to the model's ink."""

import tempfile
from pathlib import Path

import numpy as np

from wapstable.errors import UserError


def save_small(src: Path, dst: Path) -> None:
    """Copy the PNG `src` to `dst` with an adaptive palette: plots have few colours, so this loses nothing visible
    and makes the file several times smaller."""
    from PIL import Image

    with Image.open(src) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    dst.parent.mkdir(parents=True, exist_ok=True)
    small.save(dst, optimize=True)


def save_figure(fig, path: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        fig.savefig(Path(tmp) / "full.png")
        save_small(Path(tmp) / "full.png", path)
    return path


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
    return save_figure(fig, out / "samples.png")


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
        panels += crohme_panels(Path(crohme), 4)
    title = (
        "where each token is: the renderer's glyph and rule boxes, bent with the image by the augmentation"
        + (", and CROHME's traceGroups" if crohme is not None else "")
        + " ({ } ^ _ have no box)"
    )
    return box_figure(panels, n, title, out / "symbol-boxes.png")


def handwriting(out: Path, n: int = 8, seed: int = 2, crohme: Path | None = None) -> Path:
    """Rendered handwriting as experiment=handwritten draws it (data.style=handwritten, data.symbols=crohme and its
    data.frequencies), with each token's box; with `crohme` (a folder of InkML), real CROHME files beside them,
    rasterised alike."""
    from omegaconf import OmegaConf

    from wapstable.config import CONF_DIR, data_yaml
    from wapstable.data.ink.raster import Raster
    from wapstable.data.render.grammar import generate_expressions
    from wapstable.data.render.handwritten import render_handwritten
    from wapstable.data.render.mathtext import FONTS

    data = OmegaConf.merge(
        data_yaml("synthetic"), OmegaConf.load(CONF_DIR / "experiment" / "handwritten.yaml").data
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
        panels += crohme_panels(Path(crohme), 4, raster)
    title = (
        "experiment=handwritten's training images: mathtext's layout drawn as jittered stroke-font glyphs"
        + (
            "; the same with real symbols cut from CROHME files; real CROHME ink"
            if crohme is not None
            else ""
        )
    )
    return box_figure(panels, n, title, out / "handwriting.png")


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
    return save_figure(fig, out / "images.png")


def box_figure(panels: list[tuple], n: int, title: str, path: Path) -> Path:
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
    return save_figure(fig, path)


def crohme_panels(folder: Path, count: int, raster=None) -> list[tuple]:
    """The first `count` InkML files under `folder` (4 to 20 tokens) whose traceGroups give boxes, rasterised by
    `raster` (default: data=crohme's)."""
    from wapstable.config import data_yaml
    from wapstable.data.ink.raster import Raster
    from wapstable.data.ink.read import read_inkml
    from wapstable.data.latex import DataError

    cfg = data_yaml("crohme")
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
