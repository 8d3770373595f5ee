"""agentrl.queue: the versioned replay queue, its write-ahead log and its HTTP front door.

Imports here stay light (no torch, ray or transformers): the server and client modules are imported
lazily by whoever needs them.
"""

from agentrl.queue.core import PutResult, ReplayQueue, SampledBatch, Ticket

__all__ = ["PutResult", "ReplayQueue", "SampledBatch", "Ticket"]
