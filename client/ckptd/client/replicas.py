"""Checks that tensors declared the same on every rank of a group hold the same values
(`Replicated(check_equal=True)` rules of ckptd.client.layout); a collective over torch.distributed."""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch
from torch.distributed.tensor import DTensor

from ckptd.client.collectives import all_gather_to_cpu, collective_device
from ckptd.client.errors import LayoutError


def replicated_checksum(tensor: torch.Tensor) -> str:
    """A hex digest of a tensor's dtype, shape and values: equal on two ranks iff they hold the same bytes.

    Copies the tensor to the CPU if needed (meant for the small replicated tensors of TP: norms,
    biases). A DTensor is digested by its local tensor.
    """
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    data = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{data.dtype}{list(tensor.shape)}".encode())
    if data.numel():
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def verify_replicated(tensors: Mapping[str, torch.Tensor], group: torch.distributed.ProcessGroup | None = None) -> None:
    """Check that every rank of `group` (e.g. the TP group) holds the same values for each tensor.

    A collective: every rank of the group must call it with the same names (in any order).
    The digests travel as uint8 tensors (no pickling), on the CPU unless the group only has NCCL.
    Raises LayoutError on every rank naming the tensors that differ and the ranks that disagree.
    """
    dist = torch.distributed
    names = sorted(tensors)
    device = collective_device(group)
    names_digest = hashlib.blake2b("\n".join(names).encode(), digest_size=16).digest()
    header = torch.tensor(list(names_digest), dtype=torch.uint8, device=device)
    headers = all_gather_to_cpu(header, group)
    if any(not torch.equal(h, headers[0]) for h in headers):
        raise LayoutError(
            "the ranks of the group passed different sets of replicated tensors to verify_replicated; "
            "call it with the same names on every rank"
        )
    if not names:
        return
    rows = [bytes.fromhex(replicated_checksum(tensors[n])) for n in names]
    mine = torch.tensor([list(r) for r in rows], dtype=torch.uint8, device=device).reshape(len(names), 16)
    gathered = all_gather_to_cpu(mine, group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    problems = []
    for i, name in enumerate(names):
        differing = [ranks[r] for r, g in enumerate(gathered) if not torch.equal(g[i], gathered[0][i])]
        if differing:
            problems.append(f"{name!r} (ranks {differing} differ from rank {ranks[0]})")
    if problems:
        raise LayoutError(
            "tensors declared Replicated differ across tensor-parallel ranks: " + "; ".join(problems)
            + ". Find why they drift (a missing all-reduce), or declare them Replicated(check_equal=False)"
        )
