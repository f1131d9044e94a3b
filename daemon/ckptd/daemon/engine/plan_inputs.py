"""The input of a save's plan, as node 0 keeps it for each job and as a node checks it.

Every node plans a save from the same input (plan.make_save_plan is pure): every rank's tensor
metadata and node. The metadata is named by the daemon's digest of it (plan.spec_digest),
derived by the rank's daemon from what the rank sent, never by a key a client chose. Node 0
keeps each job's metadata and plans (`JobPlans`), for that job only, and checks the digests a
member node sends (checks.check_digest); a member checks node 0's answer (`check_plan_input`)
before it caches the plan it makes from it. So a save is planned only from what its own ranks
sent: issue 30, finding 1.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ckptd.daemon.errors import Aborted, UnknownFingerprint
from ckptd.daemon.plan.files import CompactExtras
from ckptd.daemon.plan.index_layout import IndexLayouts
from ckptd.daemon.plan.save_plan import SavePlan, TensorSpec, spec_digest
from ckptd.daemon.records import JoinResult

log = logging.getLogger(__name__)

PLANS_KEPT = 8  # plans node 0 keeps per job, the ones used last


def plan_key(digests: Sequence[str], node_of_rank: Sequence[int]) -> str:
    """What a plan depends on: every rank's metadata digest (plan.spec_digest) and node, both in
    rank order."""
    if len(digests) != len(node_of_rank):
        raise ValueError(f"plan_key: {len(digests)} digests but {len(node_of_rank)} nodes")
    text = "".join(map("{}|{}|{}\n".format, range(len(digests)), digests, node_of_rank))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class JobPlans:
    """What the coordinator keeps of one job between its saves: each rank's metadata under its
    digest, the plans made from it under their plan_key (at most PLANS_KEPT), the layout
    of the last index it committed and the text of its extras.

    Metadata is interned by digest: ranks with one digest (data-parallel replicas) share one
    object, so the coordinator holds each distinct layout once (memory O(distinct layouts +
    ranks)) and the planner describes it once (plan.make_save_plan groups ranks by that object).
    The digest is the daemon's own (checked against the metadata at the wire edge:
    rpc/validate.check_digest), so equal digests are equal metadata."""

    world_size: int
    specs: dict[tuple[int, str], tuple[TensorSpec, ...]] = field(default_factory=dict)  # (rank, digest) -> metadata
    plans: OrderedDict[str, SavePlan] = field(default_factory=OrderedDict)  # plan key -> plan, least recently used first
    interned: dict[str, tuple[TensorSpec, ...]] = field(default_factory=dict)  # digest -> the one object of its metadata
    index_layouts: IndexLayouts = field(default_factory=IndexLayouts)  # the last commit's index, less its checksums
    extras_texts: CompactExtras = field(default_factory=CompactExtras)  # the last commit's extras as text

    def take(self, digests: Mapping[int, str], specs: Mapping[int, tuple[TensorSpec, ...]]) -> dict[int, tuple[TensorSpec, ...]]:
        """Each joining rank's metadata: what it sent now (`specs`, kept), else what its digest
        named before. Raises UnknownFingerprint when a rank sent none and its digest is unknown."""
        taken = {}
        for rank, digest in digests.items():
            if rank in specs:
                self._describe(rank, digest, specs[rank])
            known = self.specs.get((rank, digest))
            if known is None:
                raise UnknownFingerprint()
            taken[rank] = known
        return taken

    def _describe(self, rank: int, digest: str, specs: tuple[TensorSpec, ...]) -> None:
        """Other metadata under a digest this rank named before (a caller that did not derive
        it) replaces it for every rank with that digest, and no plan made before is used again."""
        known = self.specs.get((rank, digest))
        if known is not None and known is not specs and known != specs:
            log.warning("rank %s sent other tensor metadata under digest %s than before; the job's cached plans are dropped", rank, digest[:16])
            self.plans.clear()
            self.interned[digest] = specs
            for key in [k for k in self.specs if k[1] == digest]:
                self.specs[key] = specs
        self.specs[(rank, digest)] = self.interned.setdefault(digest, specs)

    def plan(self, key: str) -> SavePlan | None:
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
        return plan

    def keep(self, key: str, plan: SavePlan) -> None:
        self.plans[key] = plan
        self.plans.move_to_end(key)
        while len(self.plans) > PLANS_KEPT:
            self.plans.popitem(last=False)

    def forget(self, key: str, plan: SavePlan) -> None:
        """Drop `plan` (not a newer one under the same key): a save made with it was refused."""
        if self.plans.get(key) is plan:
            del self.plans[key]


def check_plan_input(result: JoinResult, coordinator: str) -> None:
    """Raise Aborted unless the coordinator's metadata is what its digests say and its plan key
    is the key of those digests: a member node caches the plan it makes from them under that
    key (in the job's JobState.plans), so the key must follow from the metadata."""
    if result.specs is None:
        return
    if len(result.fingerprints) != len(result.specs) or not all(result.fingerprints):
        raise Aborted(f"the coordinator {coordinator} sent the ranks' metadata without their digests; every node must run the same ckptd version")
    matches: dict[str, bool] = {}
    for rank, (digest, specs) in enumerate(zip(result.fingerprints, result.specs)):
        if digest not in matches:  # data-parallel replicas share one digest: hashed once
            matches[digest] = spec_digest(specs) == digest
        if not matches[digest]:
            raise Aborted(f"the coordinator {coordinator} sent metadata of rank {rank} that does not match its digest; every node must run the same ckptd version")
    if plan_key(result.fingerprints, result.node_of_rank) != result.plan_key:
        raise Aborted(f"the coordinator {coordinator} sent plan key {result.plan_key[:16]}, which is not the key of the ranks' digests")
