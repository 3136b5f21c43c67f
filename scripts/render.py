"""Render LaTeX math to a PNG as the synthetic data is drawn: `python scripts/render.py LATEX OUT.png`.

The same as the installed `wapstable-render`; the code and its documentation are in `wapstable/cli/render.py`.
"""

from wapstable.cli.render import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
