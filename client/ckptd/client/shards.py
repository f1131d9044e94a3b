"""LocalShard: a rank's piece of a logical tensor at an explicit place, for states whose
sharding is known as offsets rather than as DTensor placements or layout rules (e.g. the
chunks torch.distributed.checkpoint hands a storage writer); LocalShards: several such pieces
of one tensor on one rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor

from ckptd.common.tiling import overlapping_pairs


@dataclass(frozen=True, eq=False)
class LocalShard:
    """`tensor` holds the box of the logical tensor of shape `global_shape` that starts at
    `offsets` (one per dimension, in elements) and has `tensor`'s shape.

    Put it in a state wherever a tensor may go: `{"model": {"w": LocalShard(t, (4, 0), (8, 16))}}`.
    Saving stores it as that box of the logical tensor "model/w"; the ranks' boxes together must
    cover the logical tensor (replicas allowed), as for DTensors. Loading fills `tensor` in place
    with that box of the checkpoint's tensor, whatever layout wrote it.
    """

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __init__(self, tensor: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int]) -> None:
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
            raise TypeError(f"LocalShard needs a plain local torch.Tensor, got {type(tensor).__name__} (a DTensor describes its own placement: pass it as it is)")
        offsets_t = tuple(int(o) for o in offsets)
        shape_t = tuple(int(n) for n in global_shape)
        local = tuple(tensor.shape)
        if not (len(offsets_t) == len(shape_t) == len(local)):
            raise ValueError(f"LocalShard: offsets {list(offsets_t)}, global_shape {list(shape_t)} and the tensor's shape {list(local)} must have one entry per dimension")
        for dim, (o, n, size) in enumerate(zip(offsets_t, local, shape_t)):
            if o < 0 or size < 0 or o + n > size:
                raise ValueError(
                    f"LocalShard: dimension {dim} of the shard covers [{o}, {o + n}), outside [0, {size}) of the global shape {list(shape_t)}"
                )
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "offsets", offsets_t)
        object.__setattr__(self, "global_shape", shape_t)

    def __repr__(self) -> str:
        return f"LocalShard(shape={list(self.tensor.shape)}, offsets={list(self.offsets)}, global_shape={list(self.global_shape)}, dtype={self.tensor.dtype})"


@dataclass(frozen=True, eq=False)
class LocalShards:
    """Several boxes of one logical tensor held by this rank, each a LocalShard of the same
    global shape and dtype, no two overlapping: e.g. the chunks of a ShardedTensor that DCP
    hands a storage writer, or a rank's experts as rows of a stacked expert tensor.

    Put it in a state where a tensor may go: `{"model": {"experts.w1": LocalShards([a, b])}}`
    stores `a` and `b` as two boxes of "model/experts.w1"; every rank's boxes together must cover
    the logical tensor, as for LocalShard. Loading fills each shard's tensor in place.
    """

    shards: tuple[LocalShard, ...]

    def __init__(self, shards: Sequence[LocalShard]) -> None:
        parts = tuple(shards)
        if not parts or not all(isinstance(s, LocalShard) for s in parts):
            raise TypeError("LocalShards needs a non-empty sequence of LocalShard")
        first = parts[0]
        for i, s in enumerate(parts[1:], 1):
            if s.global_shape != first.global_shape or s.tensor.dtype != first.tensor.dtype:
                raise ValueError(
                    f"LocalShards: shard {i} is a {s.tensor.dtype} box of global shape {list(s.global_shape)}, shard 0 a "
                    f"{first.tensor.dtype} box of {list(first.global_shape)}: all must be boxes of one logical tensor"
                )
        spans = [(s.offsets, tuple(o + n for o, n in zip(s.offsets, s.tensor.shape))) for s in parts if s.tensor.numel()]
        pairs, _, _ = overlapping_pairs(spans, keep=1)
        if pairs:
            i, j = pairs[0]
            raise ValueError(
                f"LocalShards: boxes at offsets {list(spans[i][0])} and {list(spans[j][0])} overlap; a rank's shards of one "
                "tensor must be disjoint (pass one of them)"
            )
        object.__setattr__(self, "shards", parts)

    def __repr__(self) -> str:
        return f"LocalShards({len(self.shards)} shards of global_shape={list(self.shards[0].global_shape)}, dtype={self.shards[0].tensor.dtype})"
