"""Entry point in a checkout: `python train.py [overrides]` composes the config and calls `wapstable.train.stages.train`.

The same as the installed `wapstable-train` (`wapstable/cli/train.py`, which documents the exit statuses).
"""

from wapstable.cli.train import main

if __name__ == "__main__":
    main()
