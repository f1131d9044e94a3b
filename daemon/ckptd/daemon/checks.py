"""Validation of what arrives over the wire, shared by the servicers: each function returns the
checked value or raises errors.InvalidRequest with a message that says what to fix."""

from __future__ import annotations

import math
from typing import Sequence

from ckptd.common import dtypes
from ckptd.common.boxes import Box
from ckptd.common.names import KINDS, check_job_id, check_tensor_name
from ckptd.daemon import errors
from ckptd.daemon.plan import TensorSpec
from ckptd.wire.v1 import checkpoint_pb2 as pb

MAX_WORLD_SIZE = 1 << 20
MAX_NDIM = 16
MAX_DIM = 1 << 48
MAX_TENSORS = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0



def check_who(who: pb.RankId) -> tuple[str, int, int]:
    job = check_job_id(who.job)
    if not 1 <= who.world_size <= MAX_WORLD_SIZE:
        raise errors.InvalidRequest(f"world_size {who.world_size} must be between 1 and {MAX_WORLD_SIZE}")
    if not 0 <= who.rank < who.world_size:
        raise errors.InvalidRequest(f"rank {who.rank} must be in [0, world_size={who.world_size})")
    return job, who.rank, who.world_size


def check_step(step: int) -> int:
    if step < 0:
        raise errors.InvalidRequest(f"step {step} must be >= 0")
    return step


def check_timeout(timeout_s: float) -> float:
    if not math.isfinite(timeout_s) or timeout_s < 0 or timeout_s > MAX_TIMEOUT_S:
        raise errors.InvalidRequest(f"timeout_s {timeout_s} must be between 0 (default) and {MAX_TIMEOUT_S:.0f}")
    return timeout_s


def tensor_specs(metas: Sequence[pb.TensorMeta]) -> list[TensorSpec]:
    """Validated TensorSpecs from the wire; raises InvalidRequest naming the tensor."""
    if len(metas) > MAX_TENSORS:
        raise errors.InvalidRequest(f"{len(metas)} tensors in one request; the limit is {MAX_TENSORS}")
    specs = []
    for meta in metas:
        name = check_tensor_name(meta.name)
        if meta.kind not in KINDS:
            raise errors.InvalidRequest(f"tensor {name!r}: kind {meta.kind!r} is not one of {', '.join(KINDS)}")
        if meta.dtype not in dtypes.DTYPE_NAMES:
            raise errors.InvalidRequest(f"tensor {name!r}: dtype {meta.dtype!r} is not one of {', '.join(sorted(dtypes.DTYPE_NAMES))}")
        shape = tuple(meta.shape)
        if len(shape) > MAX_NDIM or any(not 0 <= d <= MAX_DIM for d in shape):
            raise errors.InvalidRequest(f"tensor {name!r}: shape {list(shape)} has a negative, huge or too many dimensions")
        if math.prod(shape) * dtypes.itemsize(meta.dtype) > MAX_DIM:
            raise errors.InvalidRequest(f"tensor {name!r}: shape {list(shape)} is larger than ckptd accepts")
        if meta.HasField("box"):
            if len(meta.box.offsets) != len(shape) or len(meta.box.lengths) != len(shape):
                raise errors.InvalidRequest(f"tensor {name!r}: box has {len(meta.box.offsets)} offsets and {len(meta.box.lengths)} lengths for a {len(shape)}-dim shape")
            try:
                box = Box(tuple(meta.box.offsets), tuple(meta.box.lengths))
            except ValueError as exc:
                raise errors.InvalidRequest(f"tensor {name!r}: {exc}") from None
            if not box.fits_in(shape):
                raise errors.InvalidRequest(f"tensor {name!r}: box {box} does not lie inside shape {list(shape)}")
        else:
            box = Box.full(shape)
        aliases = tuple(check_tensor_name(a) for a in meta.aliases)
        specs.append(TensorSpec(name, meta.kind, meta.dtype, shape, box, aliases))
    return specs
