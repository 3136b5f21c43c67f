"""The ways a run ends early on purpose; the entry points (`wapstable.cli`) turn them into exit statuses."""


class UserError(ValueError):
    """Something the user can fix (config, data, checkpoint): the message names what to change."""


class TrainingStopped(RuntimeError):
    """The guard's budget ran out: the run wrote its anomaly checkpoint and stopped."""


class TrialPruned(RuntimeError):
    """A sweep's pruner stopped this trial at an evaluation (`wapstable.train.sweep`); the sweeper records it as pruned."""
