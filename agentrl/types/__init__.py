"""Trajectory types: the Structs and encoders (trajectory.py), decoding what clients send (wire.py) and the
normalization every trajectory passes before the rest of agentrl trusts it (validate.py).

Every name is importable from `agentrl.types` itself (each module's `__all__`). No torch or ray.
"""

from agentrl.types import trajectory, validate, wire
from agentrl.types.trajectory import *  # noqa: F403
from agentrl.types.validate import *  # noqa: F403
from agentrl.types.wire import *  # noqa: F403

__all__ = [*trajectory.__all__, *wire.__all__, *validate.__all__]
