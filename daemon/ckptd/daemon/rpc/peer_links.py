"""gRPC channels from this daemon to the other nodes' daemons (the Peer service), with the peer
token on every call (rpc_auth.PEER_TOKEN_KEY) and mutual TLS when configured (rpc/tls.py).
The peer client (peer_client.py), node 0's coordinator and run admission (as their
engine/peers.py `PeerProbe`) and the replica tiers (tiers/replica_links.py) call the other nodes through them.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import grpc

from ckptd.daemon.rpc.auth import PEER_TOKEN_KEY
from ckptd.daemon.rpc.tls import PeerTls
from ckptd.wire import MESSAGE_SIZE_OPTIONS, RECONNECT_OPTIONS
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc


class PeerLinks:
    """gRPC channels to the other daemons, with the token on every call."""

    def __init__(self, peers: Sequence[str], token: str, tls: PeerTls | None = None) -> None:
        self.peers = tuple(peers)
        self.tls = tls
        self._metadata = ((PEER_TOKEN_KEY, token),)
        self._channels: dict[int, grpc.aio.Channel] = {}

    def _channel(self, node: int) -> grpc.aio.Channel:
        channel = self._channels.get(node)
        if channel is None:
            options = [*MESSAGE_SIZE_OPTIONS, *RECONNECT_OPTIONS]
            if self.tls is None:
                channel = grpc.aio.insecure_channel(self.peers[node], options=options)
            else:
                channel = grpc.aio.secure_channel(self.peers[node], self.tls.channel_credentials(), options=options)
            self._channels[node] = channel
        return channel

    def stub(self, node: int) -> ppb_grpc.PeerStub:
        return ppb_grpc.PeerStub(self._channel(node))  # type: ignore[no-untyped-call]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def ready(self, node: int, within_s: float) -> bool:
        """Wait until the channel to `node` is connected; False when it is not within `within_s`
        seconds. A channel whose last attempt failed (the peer was restarting) fails every call
        at once until its reconnect backoff ends: callers that must reach a peer wait here first."""
        try:
            await asyncio.wait_for(self._channel(node).channel_ready(), within_s)
        except asyncio.TimeoutError:
            return False
        return True

    def connected(self, node: int) -> bool:
        """Whether the channel to `node` is connected now (no attempt is made)."""
        return bool(self._channel(node).get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY)

    async def saving(self, node: int, job: str, step: int, timeout_s: float = 2.0) -> bool | None:
        """Whether node's daemon is saving `step` of `job`; None when it does not answer."""
        try:
            reply = await self.stub(node).Inventory(ppb.InventoryRequest(job=job, step=step), timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError:
            return None
        return bool(reply.in_flight)

    @property
    def nodes(self) -> int:
        return len(self.peers)

    def describe(self, node: int) -> str:
        return f"node {node} ({self.peers[node]})" if 0 <= node < len(self.peers) else f"node {node}"

    async def run_attached(self, node: int, job: str, run: str, timeout_s: float = 2.0) -> bool:
        """Whether a client of `run` is attached to node's daemon; False when it does not answer
        within `timeout_s` (its ranks cannot save through it either)."""
        try:
            reply = await self.stub(node).Inventory(ppb.InventoryRequest(job=job, run_id=run), timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError:
            return False
        return bool(reply.run_attached)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
