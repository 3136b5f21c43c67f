"""Evaluate a checkpoint on a data split: `python scripts/evaluate.py CKPT [overrides] [--out JSON]`.

The same as the installed `wapstable-evaluate`; the code and its documentation are in `wapstable/cli/evaluate.py`.
"""

from wapstable.cli.evaluate import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
