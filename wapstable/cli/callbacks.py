"""Hydra callbacks of `wapstable-train` (listed under `hydra.callbacks` in conf/config.yaml)."""

import sys

from hydra.experimental.callback import Callback

from wapstable.errors import UserError
from wapstable.train.runlock import acquire


class RunLockCallback(Callback):
    """Lock a plain run's directory before Hydra writes into it (`hydra.callbacks.run_lock`): a second process on
    the same directory gets one sentence and exit 2, and Hydra's `.hydra/` and `train.log` stay as they were."""

    def on_run_start(self, config, **kwargs) -> None:
        try:
            acquire(config.hydra.run.dir)
        except UserError as e:  # a callback's exception would be a traceback and exit 1
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
