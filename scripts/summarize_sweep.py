"""One table for a Hydra sweep: `python scripts/summarize_sweep.py SWEEP_DIR [--out DIR]`.

The same as the installed `wapstable-summarize-sweep`; the code and its documentation are in `wapstable/cli/summarize_sweep.py`.
"""

from wapstable.cli.summarize_sweep import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
