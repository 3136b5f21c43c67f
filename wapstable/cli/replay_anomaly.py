"""Replay an anomaly checkpoint (`anomalies/step-N.pt`) and say where the first NaN/Inf came from.

    wapstable-replay outputs/.../anomalies/step-5.pt [--json] [--device cpu]   # or python scripts/replay_anomaly.py
    wapstable-replay PATH --set model.attention.stable=true   # does the fix make it go away?

Exit code: 1 the anomaly reproduced, 0 it did not (a transient fault, or one the overrides fixed),
2 the file is not an anomaly checkpoint (or a --set key is unknown), 3 the replay itself failed.
"""

import argparse
import json
import sys
import traceback

import torch
import yaml

from wapstable.checkpoint import load_checkpoint
from wapstable.errors import UserError
from wapstable.stability.replay import format_range, replay, summarize
from wapstable.train.summary import strict
from wapstable.train.threads import resolve_threads


def parse_overrides(items: list[str]) -> dict:
    """KEY=VALUE strings to a dict; values are read as YAML, so true, 3, 1e-4 and [1,2] get their types."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(
                f"--set {item!r} must look like KEY=VALUE, e.g. --set model.attention.stable=true"
            )
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value  # not YAML: take it as the string it is
    return out


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def render(path: str, state: dict, r: dict, top: int = 8) -> str:
    saved_bad = state["anomaly"].get("nonfinite_counts", {})
    lines = [
        f"anomaly checkpoint: {path}",
        f"saved:     step {r['step']}: {r['reason']} (loss {_num(r['saved_loss'])}, "
        f"grad norm {_num(r['saved_grad_norm'])}, {len(saved_bad)} layers with non-finite gradients)",
    ]
    if r["overrides"]:
        lines.append("overrides: " + " ".join(f"{k}={v}" for k, v in r["overrides"].items()))
    verdict = (
        "REPRODUCED" if r["reproduced"] else "not reproduced (a transient fault, or one the overrides fixed)"
    )
    lines.append(f"replay:    {verdict}; loss {_num(r['loss'])}, grad norm {_num(r['grad_norm'])}")
    if r["reproduced"]:
        lines.append(f"origin:    the {r['origin']} pass")
    lines.append(f"forward:   first non-finite module output: {r['first_forward_module'] or 'none'}")
    if r["first_forward_module"]:
        lines.append(f"           its inputs  {format_range(r['first_forward_module_inputs'], counts=True)}")
        lines.append(f"           its output  {format_range(r['first_forward_module_output'], counts=True)}")
        if r["attention_energies"]:
            lines.append(
                f"           attention energies (x{r['attention_energies']['scale']:g}) "
                f"{format_range(r['attention_energies'], counts=True)}"
            )
    if r["first_forward_op"]:
        lines.append(
            f"           first op producing {r['first_forward_op_kind']} from finite inputs: {r['first_forward_op']} "
            f"in {r['first_forward_op_module'] or '(outside the model)'}, inputs {format_range(r['first_forward_op_inputs'], counts=True)}"
        )
    if r["nonfinite_input_values"]:
        lines.append(f"           the input images hold {r['nonfinite_input_values']} non-finite values")
    lines.append(f"backward:  first non-finite module gradient: {r['first_backward_module'] or 'none'}")
    if r["first_backward_op"]:
        lines.append(
            f"           first autograd op producing {r['first_backward_op_kind']} from finite gradients: "
            f"{r['first_backward_op']}"
        )
    bad = sorted(r["nonfinite_grads"].items(), key=lambda kv: -kv[1])
    if bad:
        lines.append(
            f"non-finite gradient values per parameter (replay), top {min(top, len(bad))} of {len(bad)}:"
        )
        width = max(len(k) for k, _ in bad[:top])
        lines += [f"  {k:<{width}}  {v}" for k, v in bad[:top]]
    lines.append("summary:   " + summarize(r))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="an anomaly checkpoint, anomalies/step-N.pt")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = ap.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        try:
            state = load_checkpoint(args.path)
        except UserError:
            raise
        except Exception as e:  # torch.load fails in many ways on a file that is not a checkpoint
            raise UserError(f"{args.path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
        if "anomaly" not in state:
            raise UserError(
                f"{args.path} is a training checkpoint without an 'anomaly' entry, not an anomaly checkpoint; "
                "give a file from the run's anomalies/ folder"
            )
        # as the run did: tiny ops on many threads are slow on a busy machine
        threads = resolve_threads((state.get("config") or {}).get("trainer", {}).get("threads", 0))
        if threads > 0:
            torch.set_num_threads(threads)
        report = replay(state, args.device, overrides)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception:  # an uncaught error would exit 1, which here means "reproduced"
        traceback.print_exc()
        print(
            f"error: replaying {args.path} failed (see above); this is a bug, not a verdict", file=sys.stderr
        )
        return 3
    print(
        json.dumps(strict(report), indent=2, allow_nan=False)
        if args.json
        else render(args.path, state, report)
    )
    return 1 if report["reproduced"] else 0


def run() -> None:
    """The console entry point `wapstable-replay`."""
    sys.exit(main())


if __name__ == "__main__":
    run()
