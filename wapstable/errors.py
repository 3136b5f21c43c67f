"""The two ways a run ends early on purpose."""


class UserError(ValueError):
    """Something the user can fix (config, data, checkpoint): the message names what to change."""


class TrainingStopped(RuntimeError):
    """The guard's budget ran out: the run wrote its anomaly checkpoint and stopped."""
