"""ckptd client: hand checkpoints to the node's daemon and load them back.

    from ckptd.client import CheckpointClient
"""

from ckptd.client.client import CheckpointClient, CheckpointInfo
from ckptd.client.errors import CheckpointError, CheckpointNotFound, DaemonUnavailable, InvalidState
from ckptd.client._rpc import DurableInfo
from ckptd.client.handle import SaveHandle
from ckptd.client.shards import LocalShard, LocalShards
from ckptd.common.retention import JobRetention

__all__ = [
    "CheckpointClient",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFound",
    "DaemonUnavailable",
    "DurableInfo",
    "InvalidState",
    "JobRetention",
    "LocalShard",
    "LocalShards",
    "SaveHandle",
]
