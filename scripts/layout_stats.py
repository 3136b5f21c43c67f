"""Where writers put things, against rendered handwriting: `python scripts/layout_stats.py FOLDER [overrides]`.

The same as the installed `wapstable-layout-stats`; the code and its documentation are in `wapstable/cli/layout.py`.
"""

from wapstable.cli.layout import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
