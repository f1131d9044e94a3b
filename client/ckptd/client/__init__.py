"""ckptd client: hand checkpoints to the node's daemon and load them back.

    from ckptd.client import CheckpointClient
"""

from ckptd.client.client import CheckpointClient, CheckpointInfo
from ckptd.client.errors import CheckpointError, CheckpointNotFound, DaemonUnavailable, InvalidState
from ckptd.client._rpc import DurableInfo
from ckptd.client.handle import SaveHandle
from ckptd.client.options import ClientOptions
from ckptd.client.ranks import rank_and_world
from ckptd.client.shards import LocalShard, LocalShards
from ckptd.common.retention import JobRetention

__all__ = [
    "CheckpointClient",
    "CheckpointError",
    "CheckpointInfo",
    "ClientOptions",
    "CheckpointNotFound",
    "DaemonUnavailable",
    "DurableInfo",
    "InvalidState",
    "JobRetention",
    "LocalShard",
    "LocalShards",
    "SaveHandle",
    "rank_and_world",
]
