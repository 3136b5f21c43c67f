"""Evaluate a checkpoint on a data split: print the CROHME metrics table and write it as JSON.

    wapstable-evaluate outputs/.../checkpoints/best.pt       # in a checkout: python scripts/evaluate.py ...
    wapstable-evaluate CKPT decode.beam_size=10                       # WAP's final-evaluation beam
    wapstable-evaluate CKPT data=crohme data.root=/data/CROHME_labeled_2016 split=test    # one row per test set
    wapstable-evaluate CKPT data=crohme data.root=DIR split=test ~data.test_sets.2016      # the 2014 set only
    wapstable-evaluate CKPT data=crohme data.root=DIR split=test +data.test_sets.2013=TestINKMLGT   # one more
    wapstable-evaluate CKPT data=wap_pkl data.root=/data/wap --out results.json
    wapstable-evaluate CKPT data=crohme data.root=DIR split=test --predictions errors.jsonl   # what it got wrong
    wapstable-evaluate CKPT data.root=DIR --read-range OUT.pt    # record the symbol sizes it reads (data.read_range)

The model and its vocabulary come from the checkpoint; data, decode and trainer.device/threads come from the
checkpoint's config with the command line's Hydra-style overrides on top (a group such as `data=wap_pkl` replaces
the checkpoint's whole data config; naming the source the checkpoint was trained on, `data=crohme` for a CROHME
model, keeps its settings, such as how ink becomes pixels). On a data set with named test sets (data=crohme),
split=test prints one row per set, its ExpRate over all of the set's expressions (an unreadable one counts as
wrong). With no decode.beam_size given, the beam is the checkpoint's
decode.final_beam_size, so that the default reproduces the run's own test_exprate. The JSON goes next to the
checkpoint as eval-<split>.json unless --out says otherwise. --predictions FILE writes every expression's
reference, prediction and edit distance as JSON lines and prints the most frequent edits (which symbol was read as
which, which was dropped or added), over a least-edit alignment of each pair. --read-range OUT reads the
validation split greedily at scale 1 and at data.read_range.scales (the CROHME preset's 0.7, 0.85, 1.2 and 1.4
where the checkpoint's config has none) and writes a copy of the checkpoint to OUT whose ink_stats record the
symbol sizes the model reads, as train.py does with data.read_range (OUT may be the checkpoint itself: it is
replaced atomically). Exit code 2: a missing or bad checkpoint, override, data set or --predictions path, named
in one sentence on stderr.
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from wapstable.checkpoint import load_checkpoint, save_checkpoint
from wapstable.cli import run_script
from wapstable.config import CONF_DIR, checkpoint_config, register_configs
from wapstable.data.batches import SPLITS, check_labels, load_splits
from wapstable.data.normalize import check_read_range, read_factors, readings_at
from wapstable.errors import UserError
from wapstable.eval.evaluation import (
    check_length_power,
    check_scales,
    combine_sets,
    evaluate_samples,
    load_model,
    score_test_sets,
)
from wapstable.eval.metrics import confusions, format_confusions, format_sets_table, format_table

log = logging.getLogger("wapstable")
# Only these parts of the config mean anything here: the model is the checkpoint's.
ALLOWED = ("data", "decode", "trainer.device", "trainer.threads")
READ_SCALES = (0.7, 0.85, 1.2, 1.4)  # --read-range's scales where the checkpoint's data.read_range has none


def compose(saved: dict, overrides: list[str]):
    """The checkpoint's config with `overrides` on top: a group override swaps the group, a key sets the key."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    keys, deleted, passed = [], [], []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "data" and override.split("=", 1)[1] == str(saved.get("data", {}).get("name")):
            passed.append(override)
            continue  # the checkpoint's own data source: its settings stay (data.KEY=... still apply)
        if override.startswith("~") and "." in key and key.startswith("data."):
            deleted.append(
                key
            )  # `~data.test_sets.2016`: drop an entry of the checkpoint's config (the package's
            continue  # own config may not have it: a model of data=synthetic tested on CROHME folders)
        if "=" not in override or not any(key == a or key.startswith(a + ".") for a in ALLOWED):
            raise UserError(
                f"override {override!r} is not accepted; give data=..., data.KEY=..., decode.KEY=..., "
                "trainer.device=... or split=... (the model comes from the checkpoint)"
            )
        keys.append(key)
        passed.append(override)
    register_configs()
    try:
        # The package's configs: group options (data=crohme) and the schema's type checks, as train.py has them.
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = hydra_compose(config_name="config", overrides=passed)
    except (HydraException, OmegaConfBaseException) as e:
        why = "; ".join(line.strip() for line in str(e).splitlines()[:2])
        raise UserError(f"the overrides do not compose: {why}") from None
    try:
        cfg = checkpoint_config(saved, keys, composed)
        for key in deleted:
            parent, leaf = key.rsplit(".", 1)
            node = OmegaConf.select(cfg, parent)
            if node is None or leaf not in node:
                raise UserError(f"~{key}: the checkpoint's config has no {key} to remove")
            del node[leaf]
    except OmegaConfBaseException as e:
        raise UserError(
            f"the checkpoint's config does not fit this version: {str(e).splitlines()[0]}"
        ) from None
    return cfg


def write_lines(path: Path, records: list[dict]) -> None:
    """`records` as JSON lines at `path`, written whole or not at all (a temporary file, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(path)
    except OSError as e:
        raise UserError(
            f"cannot write --predictions {path} ({e.strerror}); give a file path that can be written"
        ) from None


def write_read_range(out: Path, ckpt: Path, model, vocab, samples, cfg, device) -> int:
    """--read-range: the validation `samples` read greedily at scale 1 and at each scale, and a copy of the checkpoint
    at `out` whose ink_stats record the range the model reads (data.read_range's measure, as train.py takes it)."""
    d = cfg.data
    if model.ink_stats is None:
        raise UserError(
            f"{ckpt} records no ink statistics (it was trained before they were kept); train it again"
        )
    scales = list(d.read_range.scales) or list(READ_SCALES)
    check_read_range(OmegaConf.create({"scales": scales, "tolerance": d.read_range.tolerance}))

    def read(f: float) -> float:
        exprate = evaluate_samples(
            model,
            vocab,
            samples,
            1,
            cfg.decode.max_len,
            d.batch.pixel_budget,
            d.batch.max_batch,
            device,
            scales=(f,),
        )["exprate"]
        print(f"scale {f:g}: valid ExpRate {exprate:.2f} % (greedy)")
        return exprate

    readings = readings_at(read, scales)
    factors = read_factors(readings, float(d.read_range.tolerance))
    if factors is None:
        raise UserError(f"{ckpt} reads none of the validation split at scale 1: there is no range to measure")
    lo, hi = factors
    before = tuple(float(v) for v in d.pixel_aug.scale)  # what a checkpoint that does not say was widened by
    ink = model.ink_stats.rescaled(factors, before=before)
    state = load_checkpoint(ckpt)
    state["ink_stats"] = ink.as_dict()
    save_checkpoint(state, out)
    print(f"read within {d.read_range.tolerance:g} points from scale {lo:g} to {hi:g}")
    print(f"recorded: {ink}\n  before: {model.ink_stats}")
    log.info("wrote %s", out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint written by train.py (best.pt, last.pt)")
    p.add_argument("overrides", nargs="*", help="data=..., data.KEY=..., decode.KEY=..., split=valid|test")
    p.add_argument(
        "--out", help="where to write the JSON (default: eval-<split>.json next to the checkpoint)"
    )
    p.add_argument(
        "--predictions",
        metavar="FILE",
        help="write each expression's reference, prediction and edit distance here (JSON lines) and print the "
        "most frequent edits",
    )
    p.add_argument(
        "--read-range",
        metavar="OUT",
        help="read the validation split at data.read_range.scales and write a copy of the checkpoint to OUT "
        "recording the symbol sizes its model reads, for data.normalize",
    )
    args = p.parse_intermixed_args(argv)  # options before or after the overrides
    if args.read_range and Path(args.read_range).is_dir():
        raise UserError(
            f"--read-range {args.read_range} is a folder; give the path of the checkpoint to write"
        )
    if args.predictions and Path(args.predictions).is_dir():
        raise UserError(f"--predictions {args.predictions} is a folder; give the path of a file to write")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)

    split = "valid" if args.read_range else "test"
    overrides = []
    for o in args.overrides:
        if o.startswith("split="):
            split = o.split("=", 1)[1]
        else:
            overrides.append(o)
    if split not in SPLITS:
        raise UserError(f"split={split} is unknown; use one of {', '.join(SPLITS)}")
    if args.read_range and split != "valid":
        raise UserError(f"--read-range measures on the validation split; leave split={split} out")

    from wapstable.device import resolve_device
    from wapstable.train.threads import resolve_threads

    ckpt = Path(args.checkpoint)
    model, vocab, saved = load_model(ckpt, "cpu")
    cfg = compose(OmegaConf.to_container(saved, enum_to_str=True), overrides)
    given = any(o.startswith("decode.beam_size=") for o in overrides)
    beam = cfg.decode.beam_size if given else cfg.decode.final_beam_size
    d = cfg.data
    if beam <= 0 or cfg.decode.max_len <= 0:
        raise UserError("decode.beam_size and decode.max_len must be positive")
    check_scales(cfg.decode.scales)
    length_power = float(cfg.decode.length_power)
    check_length_power(length_power)
    device = resolve_device(cfg.trainer.device)
    threads = resolve_threads(cfg.trainer.threads)
    if threads > 0:
        torch.set_num_threads(threads)

    model = model.to(device)
    splits = load_splits(d, which=(split,), ink=model.ink_stats)
    samples = check_labels(splits[split], vocab, d.on_error)
    if not samples:
        raise UserError(f"no {split} sample of data={d.name} is left to evaluate")
    if args.read_range:
        return write_read_range(Path(args.read_range), ckpt, model, vocab, samples, cfg, device)
    log.info("evaluating %s on %d %s samples of data=%s, beam %d", ckpt, len(samples), split, d.name, beam)
    t0 = time.perf_counter()

    predictions: list | None = [] if args.predictions else None

    def evaluate(group):
        return evaluate_samples(
            model,
            vocab,
            group,
            beam,
            cfg.decode.max_len,
            d.batch.pixel_budget,
            d.batch.max_batch,
            device,
            predictions=predictions,
            scales=tuple(cfg.decode.scales),
            length_power=length_power,
        )

    sets = splits.report["test_sets"] if split == "test" else {}
    if sets:
        scored = score_test_sets(evaluate, samples, sets)
        result = {**combine_sets(scored), "sets": scored}
    else:
        result = evaluate(samples)
    seconds = time.perf_counter() - t0
    print(format_sets_table(scored) if sets else format_table(result))
    if predictions is not None:
        predictions.sort(key=lambda r: r["id"])
        print()
        print(format_confusions(confusions((r["truth"], r["prediction"]) for r in predictions)))
        write_lines(Path(args.predictions), predictions)
        log.info("wrote %d predictions to %s", len(predictions), args.predictions)
    out = Path(args.out) if args.out else ckpt.parent / f"eval-{split}.json"
    record = {
        **result,
        "checkpoint": str(ckpt),
        "split": split,
        "data": d.name,
        "beam_size": beam,
        "scales": [float(v) for v in cfg.decode.scales],
        "length_power": length_power,
        "max_len": cfg.decode.max_len,
        "seconds": round(seconds, 2),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    log.info("wrote %s (%.1f s)", out, seconds)
    return 0


def run() -> None:
    """The console entry point `wapstable-evaluate`."""
    run_script(main)


if __name__ == "__main__":
    run()
