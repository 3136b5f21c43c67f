"""Benchmark the trainer's costs as ratios, side by side: `python scripts/bench.py [--quick] [overrides]`.

The same as the installed `wapstable-bench`; the code and its documentation are in `wapstable/cli/bench.py`.
"""

from wapstable.cli.bench import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
