"""Recognise the expression in image files with a checkpoint: prints `IMAGE<TAB>latex` per image.

    wapstable-predict outputs/.../checkpoints/best.pt formula.png     # in a checkout: python scripts/predict.py ...
    wapstable-predict CKPT a.png b.jpg --beam 10 --attention att.png     # att-1.png, att-2.png

Each image is brought to the training convention first: gray, ink bright on a dark background (`--invert auto`
inverts an image whose background is bright, such as a scan or a rendering of dark ink on white), background
removed, cropped to the ink plus a 4 px margin, and scaled to `--height` rows (default: data.height for a model
trained on CROHME InkML at data.scale=height; otherwise the image's own size, shrunk only if over data.batch.max_image_pixels). A model reads
best at the scale it was trained on: for a synthetic-data model, type of its data.font_size (28 pt) at 72 dpi.
`--attention out.png` draws, per image, the prepared image and one panel per decoded token with the attention
the model paid while emitting it. Exit code 2: an unreadable checkpoint or image, named on stderr.
"""

import argparse
from pathlib import Path

import torch

from wapstable.cli import run_script
from wapstable.errors import UserError
from wapstable.eval.attention_maps import save_attention_image
from wapstable.eval.evaluation import (
    load_model,
    predict_image,
    prepare_image,
    read_image,
)


def attention_path(out: Path, n: int, total: int) -> Path:
    """out.png for one image, out-1.png .. out-N.png for several."""
    return out if total == 1 else out.with_name(f"{out.stem}-{n}{out.suffix or '.png'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint written by train.py (best.pt, last.pt)")
    p.add_argument("images", nargs="+", help="image files (PNG, JPG, ...)")
    p.add_argument(
        "--beam", type=int, default=None, help="beam size (default: the checkpoint's final_beam_size)"
    )
    p.add_argument(
        "--max-len", type=int, default=None, help="most tokens (default: the checkpoint's max_len)"
    )
    p.add_argument("--attention", metavar="OUT.png", help="write the attention maps of each image")
    p.add_argument("--invert", choices=("auto", "yes", "no"), default="auto", help="make the ink bright")
    p.add_argument("--height", type=int, default=None, help="scale the cropped image to this many rows")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    args = p.parse_args(argv)

    from wapstable.device import resolve_device

    device = resolve_device(args.device)
    model, vocab, cfg = load_model(args.checkpoint, device)
    beam = args.beam or cfg.decode.final_beam_size
    max_len = args.max_len or cfg.decode.max_len
    if beam <= 0 or max_len <= 0:
        raise UserError("--beam and --max-len must be positive")
    fixed = cfg.data.name == "crohme" and cfg.data.get("scale", "height") == "height"
    height = args.height or (cfg.data.height if fixed else None)
    if height is not None and height < 8:
        raise UserError(f"--height {height} is too small to hold an expression; use 32 or more")
    # Every image is read before any is decoded: a typo in the last name fails in a second, not after the rest.
    images = []
    for f in args.images:
        try:
            images.append(
                prepare_image(
                    read_image(f), args.invert, height, cfg.data.batch.max_image_pixels, model.ink_stats
                )
            )
        except UserError as e:
            raise UserError(f"{f}: {e}" if str(f) not in str(e) else str(e)) from None
    with torch.inference_mode():
        for n, (name, image) in enumerate(zip(args.images, images), 1):
            seq, att = predict_image(model, image, beam, max_len)
            tokens = vocab.decode(seq)
            latex = " ".join(tokens)
            print(f"{name}\t{latex}", flush=True)
            if args.attention:
                out = attention_path(Path(args.attention), n, len(images))
                out.parent.mkdir(parents=True, exist_ok=True)
                title = f"{Path(name).name}: {latex or '(nothing)'}"
                save_attention_image(
                    out, image, att[: len(tokens)], model.watcher.stride, tokens, title=title
                )
    return 0


def run() -> None:
    """The console entry point `wapstable-predict`."""
    run_script(main)


if __name__ == "__main__":
    run()
