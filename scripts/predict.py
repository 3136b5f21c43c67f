"""Recognise the expression in image files: `python scripts/predict.py CKPT IMAGE [...] [--attention OUT.png]`.

The same as the installed `wapstable-predict`; the code and its documentation are in `wapstable/cli/predict.py`.
"""

from wapstable.cli.predict import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
