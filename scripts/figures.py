"""Draw the documentation's pictures into docs/: `python scripts/figures.py [--run RUN_DIR] [--checkpoint CKPT]`.

The same as the installed `wapstable-figures` and `make figures`; the code and its documentation are in
`wapstable/cli/figures.py`.
"""

from wapstable.cli.figures import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
