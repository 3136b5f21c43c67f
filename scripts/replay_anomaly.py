"""Replay an anomaly checkpoint and say where the first NaN/Inf came from: `python scripts/replay_anomaly.py PATH`.

The same as the installed `wapstable-replay`; code and documentation are in `wapstable/cli/replay_anomaly.py`.
"""

from wapstable.cli.replay_anomaly import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
