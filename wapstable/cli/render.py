"""Render LaTeX math to a PNG with the synthetic data's renderer: a test image for predict.py at training scale.

    wapstable-render '\\frac{a+1}{b}' fraction.png                # in a checkout: python scripts/render.py ...
    wapstable-render 'x^{2}+y_{i}' script.png --font stix --font-size 28 --augment --seed 3
    wapstable-render RIT_2014_1.inkml real.png --symbol-size 24 --height 160    # CROHME ink as data=crohme draws it

An argument ending in `.inkml` is a CROHME file: its strokes are drawn as `data=crohme` draws them (`--height`,
`--symbol-size` for data.scale=symbol, `--line-width`), so predict.py sees what the model was trained on.

The expression is tokenised as CROHME labels are, then drawn by matplotlib mathtext exactly as `data=synthetic`
draws training images (`--font-size` should match the model's `data.font_size`; `--augment` applies the same
random affine/elastic/blur bending). The PNG is dark ink on white, as a scan would be; predict.py inverts it back.
Exit code 2: an expression mathtext cannot draw, or an unknown font.
"""

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from wapstable.cli import run_script
from wapstable.data.latex import tokenize_latex
from wapstable.data.render.mathtext import FONTS, render, tokens_to_mathtext
from wapstable.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("latex", help="the expression, e.g. '\\frac{a}{b}' (no $ needed), or a CROHME .inkml file")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--font", default="cm", choices=FONTS, help="mathtext font set (default: cm)")
    p.add_argument(
        "--font-size", type=int, default=28, help="points at 72 dpi (default: 28, as data.font_size)"
    )
    p.add_argument("--augment", action="store_true", help="bend it as training images are")
    p.add_argument("--seed", type=int, default=0, help="the augmentation's random seed")
    p.add_argument("--height", type=int, default=64, help="InkML: data.height (default: 64)")
    p.add_argument("--symbol-size", type=int, default=0, help="InkML: data.symbol_size for data.scale=symbol")
    p.add_argument("--line-width", type=int, default=2, help="InkML: data.line_width (default: 2)")
    args = p.parse_args(argv)
    if args.latex.endswith(".inkml"):
        from wapstable.data.ink.raster import Raster
        from wapstable.data.ink.read import read_inkml

        sample = read_inkml(args.latex, Raster(args.height, args.line_width, float(args.symbol_size)))
        tokens, img = sample.tokens, sample.image
    else:
        tokens, img = render_latex(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(255 - img).save(args.out)
    print(f"{args.out}\t{' '.join(tokens)}\t{img.shape[1]}x{img.shape[0]} px")
    return 0


def render_latex(args) -> tuple[list[str], np.ndarray]:
    tokens = tokenize_latex(args.latex.strip().strip("$"))
    if not tokens:
        raise UserError("the expression is empty; give some LaTeX math, e.g. 'x^{2}'")
    try:
        img = render(tokens, args.font, args.font_size, np.random.default_rng(args.seed), args.augment)
    except ValueError as e:
        raise UserError(
            f"mathtext cannot draw {tokens_to_mathtext(tokens)}: {str(e).splitlines()[0]}"
        ) from None
    return tokens, img


def run() -> None:
    """The console entry point `wapstable-render`."""
    run_script(main)


if __name__ == "__main__":
    run()
