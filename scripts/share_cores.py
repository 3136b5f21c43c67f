"""Two and three trainings at once against one alone, side by side: `python scripts/share_cores.py [--quick]`.

The same as the installed `wapstable-share-cores`; the code and its documentation are in `wapstable/cli/share.py`.
"""

from wapstable.cli.share import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
