"""Exceptions raised by TrainStream."""


class TrainStreamError(RuntimeError):
    """Base class of TrainStream's own errors."""


class DaemonError(TrainStreamError):
    """The daemon is unreachable, died, or closed this session.

    Raised by ``step()`` (and by anything that waits on the daemon) instead of
    hanging; the message says what happened and what to check.
    """


class NonFiniteGradientError(TrainStreamError):
    """A gradient held NaN or Inf, so the daemon did not apply the step."""
