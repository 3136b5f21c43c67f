"""Where writers put things, against rendered handwriting: `python scripts/layout_stats.py FOLDER [overrides]`.

    python scripts/layout_stats.py DIR/TrainINKML                       # the preset's drawing (experiment=handwritten)
    python scripts/layout_stats.py DIR/TrainINKML data.spacing=0 --files 200

Reads `--files` CROHME InkML files spread evenly over the sorted files of FOLDER (a training folder: never a test
set), draws each one's label again as `data.style=handwritten` draws it (experiment=handwritten with the overrides
given), and prints the 10th, 50th and 90th percentiles of the same measures on both, from the symbol boxes (the
traceGroups of the ink, the strokes' boxes of the drawing), in letter heights (the median height of an expression's
one-character letters and digits):

- `gap`: from one drawn symbol's right edge to the next one's left edge, for neighbouring symbols in the label;
- `frac up` / `frac down`: from a fraction's numerator to its bar, from the bar to its denominator;
- `frac left` / `frac right`: how far the bar reaches beyond its numerator and denominator;
- `sub size`, `sub shift`, `sub gap` (and `sup ...`): a one-symbol script's height as a share of its base's, its
  centre's shift below the base's centre and its gap after the base, in base heights;
- `letter px`: the letter height itself, in pixels of the image (one per expression): how the sizes of whole
  expressions spread (data.size_jitter), as drawn before the training warp (data.warp) shrinks them further.

Each row counts only the places measurable in both, so the two columns describe the same places.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np

from wapstable.cli import run_script
from wapstable.errors import UserError

MEASURES = (
    "gap",
    "frac up",
    "frac down",
    "frac left",
    "frac right",
    "sub size",
    "sub shift",
    "sub gap",
    "sup size",
    "sup shift",
    "sup gap",
    "letter px",
)
_SPACED = frozenset({"\\frac", "\\sqrt", "{", "}", "^", "_", "\\limits"})


def _finite(*boxes) -> bool:
    return all(b is not None and np.isfinite(b).all() for b in boxes)


def _union(boxes: np.ndarray, lo: int, hi: int) -> np.ndarray | None:
    b = boxes[lo : hi + 1]
    b = b[np.isfinite(b).all(1)]
    if not len(b):
        return None
    return np.array([b[:, 0].min(), b[:, 1].min(), b[:, 2].max(), b[:, 3].max()])


def measure(tokens: list[str], boxes: np.ndarray) -> dict[tuple[str, int], float]:
    """Every measure of one label's boxes, keyed by (measure, token index), so that a real file and its drawing can be
    matched place by place."""
    from wapstable.data.render.placement import SCRIPT_MOVES, closing_brace

    heights = [
        b[3] - b[1] for t, b in zip(tokens, boxes) if len(t) == 1 and t.isalnum() and np.isfinite(b).all()
    ]
    h = float(np.median(heights)) if heights else 0.0
    if not h > 0:
        return {}
    out = {("letter px", -1): h}
    for i in range(len(tokens) - 1):
        a, b = boxes[i], boxes[i + 1]
        if tokens[i] not in _SPACED and tokens[i + 1] not in _SPACED and _finite(a, b):
            out[("gap", i)] = (b[0] - a[2]) / h
    for i, t in enumerate(tokens):
        if t == "\\frac" and i + 1 < len(tokens) and tokens[i + 1] == "{":
            end_num = closing_brace(tokens, i + 1)
            if end_num + 1 >= len(tokens) or tokens[end_num + 1] != "{":
                continue
            end_den = closing_brace(tokens, end_num + 1)
            bar, num, den = (
                boxes[i],
                _union(boxes, i + 2, end_num - 1),
                _union(boxes, end_num + 2, end_den - 1),
            )
            if _finite(bar, num, den):
                out[("frac up", i)] = (bar[1] - num[3]) / h
                out[("frac down", i)] = (den[1] - bar[3]) / h
                out[("frac left", i)] = (min(num[0], den[0]) - bar[0]) / h
                out[("frac right", i)] = (bar[2] - max(num[2], den[2])) / h
        name = {"_": "sub", "^": "sup"}.get(t)
        if name and t in SCRIPT_MOVES and 0 < i and i + 3 < len(tokens) and tokens[i + 1] == "{":
            if tokens[i + 3] != "}" or tokens[i - 1] in _SPACED:
                continue
            base, script = boxes[i - 1], boxes[i + 2]
            hb = base[3] - base[1] if _finite(base) else 0.0
            if _finite(base, script) and hb >= 3:
                out[(f"{name} size", i)] = (script[3] - script[1]) / hb
                out[(f"{name} shift", i)] = (script[1] + script[3] - base[1] - base[3]) / 2 / hb
                out[(f"{name} gap", i)] = (script[0] - base[2]) / hb
    return out


def compare(folder: Path, overrides: list[str], files: int, seed: int) -> dict:
    """{measure: {"n", "real", "drawn"}} over `files` InkML files of `folder` and their labels drawn again."""
    from wapstable.cli.bench import compose
    from wapstable.config import register_configs
    from wapstable.data.ink.raster import Raster
    from wapstable.data.ink.read import read_inkml
    from wapstable.data.latex import DataError
    from wapstable.data.render import handwritten
    from wapstable.data.sources import synthetic

    register_configs()
    cfg = compose(["experiment=handwritten", *overrides]).data
    if str(cfg.style) != "handwritten":
        raise UserError(f"data.style={cfg.style}: the layout is compared for data.style=handwritten only")
    straying = {**synthetic.GLYPH_STRAYING, **synthetic.straying(cfg)}
    paths = sorted(Path(folder).expanduser().rglob("*.inkml"))
    if not paths:
        raise UserError(f"{folder}: no .inkml files; give a CROHME training folder such as DIR/TrainINKML")
    if files < 1:
        raise UserError(f"--files {files}: give at least 1")
    picked = [paths[i] for i in sorted({int(k * len(paths) / files) for k in range(min(files, len(paths)))})]
    raster = Raster.of(cfg)
    fonts = [str(f) for f in cfg.fonts]
    rows: dict[str, list[tuple[float, float]]] = {m: [] for m in MEASURES}
    for k, path in enumerate(picked):
        try:
            real = read_inkml(path, raster)
        except DataError:
            continue
        if real.boxes is None:  # no traceGroups, or not one per symbol: nothing to measure
            continue
        rng = np.random.default_rng([seed, k])
        try:
            _, boxes = handwritten.render_handwritten(
                real.tokens,
                fonts[int(rng.integers(len(fonts)))],
                int(cfg.font_size),
                rng,
                raster,
                **straying,  # the keys of GLYPH_STRAYING are render_handwritten's
            )
        except ValueError:  # a label mathtext cannot lay out
            continue
        a, b = measure(real.tokens, real.boxes), measure(real.tokens, boxes)
        for key in a.keys() & b.keys():
            rows[key[0]].append((a[key], b[key]))
    out = {}
    for m, pairs in rows.items():
        v = np.array(pairs).reshape(-1, 2)
        pct = np.percentile(v, [10, 50, 90], axis=0).T.round(3).tolist() if len(v) else [[math.nan] * 3] * 2
        out[m] = {"n": len(v), "real": pct[0], "drawn": pct[1]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a folder of CROHME InkML files (a training folder, e.g. DIR/TrainINKML)")
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides on experiment=handwritten, e.g. data.spacing=0"
    )
    p.add_argument(
        "--files", type=int, default=500, help="how many files, spread over the folder (default 500)"
    )
    p.add_argument("--seed", type=int, default=0, help="the drawings' random seed")
    p.add_argument("--out", help="also write the table as JSON here")
    args = p.parse_args(argv)
    table = compare(Path(args.folder), args.overrides, args.files, args.seed)
    print(f"{'measure':<11} {'n':>5}   {'real 10/50/90':>22}   {'drawn 10/50/90':>22}")
    for m, row in table.items():
        real = " ".join(f"{x:6.2f}" for x in row["real"])
        drawn = " ".join(f"{x:6.2f}" for x in row["drawn"])
        print(f"{m:<11} {row['n']:>5}   {real:>22}   {drawn:>22}")
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))
    return 0


def run() -> None:
    """The console entry point `wapstable-layout-stats`."""
    run_script(main)


if __name__ == "__main__":
    run()
