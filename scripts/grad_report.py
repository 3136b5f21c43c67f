"""Gradient report of runs' grad_stats.csv: `python scripts/grad_report.py RUN_DIR [...]`.

The same as the installed `wapstable-grad-report`; the code and its documentation are in `wapstable/cli/grad_report.py`.
"""

from wapstable.cli.grad_report import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
