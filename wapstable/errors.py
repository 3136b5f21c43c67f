"""The ways a run ends early on purpose, and how a script reports the first."""

import sys
from collections.abc import Callable


class UserError(ValueError):
    """Something the user can fix (config, data, checkpoint): the message names what to change."""


class TrainingStopped(RuntimeError):
    """The guard's budget ran out: the run wrote its anomaly checkpoint and stopped."""


class TrialPruned(RuntimeError):
    """A sweep's pruner stopped this trial at an evaluation (`wapstable.train.sweep`); the sweeper records it as pruned."""


def run_script(main: Callable[[], int]) -> None:
    """Exit with `main()`'s status; a UserError is one `error:` line on stderr and exit status 2."""
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
