"""What the engine asks of the other nodes, as protocols (the engine speaks no gRPC): the
coordination of a save (`Coordination`: the peer client of rpc/peer_client.py over the Peer
service, or an in-process coordinator of one node, engine/coordinator.py `SingleNode`), the
peers' inventories and files (`Peers`), and what node 0's coordinator probes while a save runs
(`PeerProbe`: rpc/peer_links.py over gRPC, `NoPeers` for a single node).
"""

from __future__ import annotations

from typing import Protocol

from ckptd.daemon.engine.requests import JoinSave, ReportManifest
from ckptd.daemon.records import JoinResult, Outcome, PeerInventory


class Coordination(Protocol):
    """Where a save's nodes meet and its commit is decided: the cluster (several nodes) or an
    in-process coordinator of one node (engine/coordinator.py SingleNode); the same protocol either way."""

    async def join_save(self, request: JoinSave) -> JoinResult:
        """Join the save; returns once every rank of the job has (the plan's input, the compression).
        Raises RunRefused when the run may not save into the job (engine/runs.py)."""

    async def report(self, request: ReportManifest) -> Outcome:
        """Report this node's written part (or its failure, manifest None); returns once decided."""



class Peers(Coordination, Protocol):
    """This node's view of the other nodes (rpc/peer_client.py `PeerClient`): who they are, what
    they hold of a step, and their files' bytes. Nodes are numbered 0..nodes-1; node 0 runs the
    coordinator."""

    node: int
    root_id: str  # this node's root id (storage.catalog.root_id): equal ids mean one shared root

    @property
    def nodes(self) -> int:
        """The number of nodes, this one included."""

    def describe(self, node: int) -> str:
        """`node N (address)`, for messages."""

    def coordinator_problem(self, waited_s: float) -> str | None:
        """Why a save waiting `waited_s` seconds cannot reach node 0, or None."""

    async def inventory(self, node: int, job: str, step: int, newest: bool = False) -> PeerInventory | str:
        """What `node` holds of a step (with `newest`, also its newest committed step of the
        job), or why it did not answer."""

    async def fetch(self, node: int, job: str, step: int, file: str, offset: int, nbytes: int, out_fd: int) -> None:
        """Copy bytes [offset, offset + nbytes) of a peer's step file to the same offset of out_fd."""

    async def fetch_bytes(self, node: int, job: str, step: int, file: str, limit: int = ...) -> bytes:
        """A whole small file (at most `limit` bytes) of a peer's committed step."""


class PeerProbe(Protocol):
    """What node 0's coordinator asks the other nodes while a save runs."""

    @property
    def nodes(self) -> int:
        """The number of nodes, this one included."""

    def describe(self, node: int) -> str:
        """`node N (address)`, for messages."""

    async def saving(self, node: int, job: str, step: int) -> bool | None:
        """Whether `node`'s daemon is saving `step` of `job`; None when it does not answer."""

    async def run_attached(self, node: int, job: str, run: str) -> bool:
        """Whether a client of `run` is attached to `node`'s daemon (False when it does not
        answer: its ranks cannot save through it either)."""


class NoPeers:
    """The probe of a daemon without peers."""

    nodes = 1

    def describe(self, node: int) -> str:
        return f"node {node}"

    async def saving(self, node: int, job: str, step: int) -> bool | None:
        return None

    async def run_attached(self, node: int, job: str, run: str) -> bool:
        return False
