"""Where a DTensor's local shard sits in its global tensor: the pure arithmetic of placements
(ckptd.client.layout uses it for DTensors; tests check it against torch's own cutting)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ckptd.client.errors import LayoutError
from ckptd.common.boxes import Box


@dataclass(frozen=True)
class Piece:
    """A part of a rank's shard that is one box of the global tensor.

    box: where it sits in the global tensor. local: where it sits in the rank's local tensor.
    """

    box: Box
    local: Box


def dtensor_pieces(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> tuple[tuple[int, ...], list[Piece]]:
    """The local shape of a DTensor's shard at mesh `coordinate`, and its pieces of the global tensor.

    Pure arithmetic, equal to what DTensor does: placements apply left to right, each splitting
    the part that the earlier ones left along its dim like torch.chunk (chunks of ceil(n / k),
    the last ones short or empty); `_StridedShard(d, split_factor=f)` first cuts that part into
    f chunks, splits each over the mesh dim, and joins the rank's pieces. Replicate splits
    nothing. A shard that is one box (all but strided shards) is one piece; an empty shard is one
    piece with an empty box placed at the global end of its empty dims (as
    torch's compute_local_shape_and_global_offset does). Raises LayoutError for Partial.
    """
    if len(mesh_shape) != len(placements) or len(coordinate) != len(placements):
        raise ValueError(
            f"mesh shape {list(mesh_shape)}, coordinate {list(coordinate)} and placements {list(placements)} "
            "must have one entry per mesh dim"
        )
    runs: list[list[tuple[int, int]]] = [[(0, int(n))] if n else [] for n in global_shape]
    for placement, n, i in zip(placements, mesh_shape, coordinate):
        if isinstance(placement, _StridedShard):  # not a Shard subclass in recent torch; test it first
            d = _shard_dim(placement.dim, global_shape)
            factor = int(placement.split_factor)
            parts = [_take(runs[d], *_chunk(_length(runs[d]), factor, j)) for j in range(factor)]
            runs[d] = _merge([r for part in parts for r in _take(part, *_chunk(_length(part), n, i))])
        elif isinstance(placement, Shard):
            d = _shard_dim(placement.dim, global_shape)
            runs[d] = _take(runs[d], *_chunk(_length(runs[d]), n, i))
        elif placement.is_partial():
            raise LayoutError(
                f"placement {placement} holds partial sums, not values: reduce it before saving "
                "(e.g. dtensor.redistribute(placements=[Replicate()] * mesh.ndim))"
            )
        elif not isinstance(placement, Replicate):
            raise LayoutError(f"placement {placement!r} is not one that ckptd knows (Shard, Replicate, _StridedShard)")
    local_shape = tuple(_length(r) for r in runs)
    if 0 in local_shape:
        offsets = tuple(r[0][0] if r else int(n) for r, n in zip(runs, global_shape))
        return local_shape, [Piece(Box(offsets, local_shape), Box((0,) * len(local_shape), local_shape))]
    per_dim = [_with_local_offsets(r) for r in runs]
    pieces = []
    for combo in itertools.product(*per_dim):
        box = Box(tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo))
        local = Box(tuple(o for _, o, _ in combo), box.lengths)
        pieces.append(Piece(box, local))
    return local_shape, pieces


def _shard_dim(dim: int, global_shape: Sequence[int]) -> int:
    if not -len(global_shape) <= dim < len(global_shape):
        raise LayoutError(f"a placement shards dim {dim} of a tensor of shape {list(global_shape)}")
    return dim % len(global_shape)


def _chunk(total: int, n: int, i: int) -> tuple[int, int]:
    """(start, length) of the i-th of n chunks of `total` items, as torch.chunk (padded with empties) cuts them."""
    size = -(-total // n)
    start = min(total, i * size)
    return start, min(total, start + size) - start


def _length(runs: list[tuple[int, int]]) -> int:
    return sum(n for _, n in runs)


def _take(runs: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """Items [start, start + length) of the sequence that `runs` (global start, length) describe, as runs."""
    out = []
    pos = 0
    for g, n in runs:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
    return out


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for g, n in runs:
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((g, n))
    return out


def _with_local_offsets(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    out, local = [], 0
    for g, n in runs:
        out.append((g, local, n))
        local += n
    return out
