"""One small error tree: every error agentrl raises on purpose is an `AgentRLError`.

Each error names the field, flag or setting at fault so that the message alone says what to change.
"""

from __future__ import annotations


class AgentRLError(Exception):
    """Base of every error agentrl raises on purpose."""


class ConfigError(AgentRLError):
    """A config key, value or flag is wrong; the message names it (and the closest valid key)."""


class InvalidTrajectory(AgentRLError):
    """A trajectory breaks the wire format; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueFull(AgentRLError):
    """Admission control refused a put (count, byte or staleness-window cap); retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueClosed(AgentRLError):
    """The queue is draining or closed and accepts no more trajectories."""


class StorageError(AgentRLError):
    """The write-ahead log could not persist a record (disk full, I/O error); nothing was acknowledged."""


class LockHeld(AgentRLError):
    """Another live process owns this run directory or queue log; `pid` is the holder (None if unknown)."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


class EngineError(AgentRLError):
    """An inference engine failed, refused a request or did not answer within its timeout."""


class WeightSyncError(EngineError):
    """Publishing a weight version to an engine failed or timed out."""


class LearnerError(AgentRLError):
    """The learner could not build a batch, step, save or load."""


class EnvError(AgentRLError):
    """An environment is unknown, failed to load, or misbehaved."""


class DataError(AgentRLError):
    """A dataset row is malformed; the message names the file, line and key."""
