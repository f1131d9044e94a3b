"""Validation of what arrives over the wire, the one validator of both servicers: each function
returns the checked value or raises errors.InvalidRequest with a message that says what to fix.
A servicer method checks its request here, calls the engine, and converts (rpc_convert). The
requests the engine takes whole (engine/requests.py) are built here, once: `begin_save_of`,
`plan_load_of`, `join_save_of`."""

from __future__ import annotations

import json
import math
from itertools import chain, repeat
from operator import attrgetter
from typing import Any, Callable, Mapping, Sequence

from ckptd.common import dtypes
from ckptd.common.blocks import QuantError
from ckptd.common.boxes import Box
from ckptd.common.names import FROZEN_CLASSES, KINDS, MAX_EXTRAS_JSON_DEPTH, check_job_id, check_run_id, check_tensor_name, json_depth, tensor_names_valid
from ckptd.common.quant_options import check_master_mode, check_scheme
from ckptd.common.sizes import human_bytes
from ckptd.daemon import errors
from ckptd.daemon.engine.requests import BeginSave, JoinSave, PlanLoad
from ckptd.daemon.engine.runs import NO_CLAIM, RunClaim
from ckptd.format.index import MODEL_FILES, FileRecord
from ckptd.format.units import Unit, tiling_problem
from ckptd.daemon.plan.compression import SaveOptions
from ckptd.daemon.plan.retention import JobRetention
from ckptd.daemon.plan.save_plan import TensorSpec, spec_digest
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import peer_pb2 as ppb

MAX_WORLD_SIZE = 1 << 20
MAX_NDIM = 16
MAX_DIM = 1 << 48
MAX_TENSORS = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_MODEL_FILE_BYTES = 1 << 20
MAX_STAGED_RANGES = 1 << 20
MAX_FINGERPRINT = 256  # characters
MAX_KNOWN_PLANS = 8
KINDS_SET, FROZEN_SET = frozenset(KINDS), frozenset(FROZEN_CLASSES)



def check_who(who: pb.RankId) -> tuple[str, int, int]:
    job = check_job_id(who.job)
    if not 1 <= who.world_size <= MAX_WORLD_SIZE:
        raise errors.InvalidRequest(f"world_size {who.world_size} must be between 1 and {MAX_WORLD_SIZE}")
    if not 0 <= who.rank < who.world_size:
        raise errors.InvalidRequest(f"rank {who.rank} must be in [0, world_size={who.world_size})")
    return job, who.rank, who.world_size


def check_run(who: pb.RankId) -> str:
    """The run id of a request ("" for a client older than run ids)."""
    return check_run_id(who.run_id) if who.run_id else ""


def check_client_id(who: pb.RankId, required: bool = False) -> str:
    """The client id of a request ("" for a client older than client ids, unless required)."""
    client_id = who.client_id
    if not client_id and not required:
        return ""
    if not 8 <= len(client_id) <= 64 or not client_id.isascii() or not client_id.isalnum():
        raise errors.InvalidRequest(f"client id {client_id[:80]!r} must be 8-64 ASCII letters and digits")
    return client_id


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
    specs = _specs_by_columns(metas)
    return specs if specs is not None else [_tensor_spec(meta) for meta in metas]


def _tensor_spec(meta: pb.TensorMeta) -> TensorSpec:
    """One TensorSpec, every field checked; raises InvalidRequest naming the tensor."""
    name = check_tensor_name(meta.name)
    if meta.kind not in KINDS:
        raise errors.InvalidRequest(f"tensor {name!r}: kind {meta.kind!r} is not one of {', '.join(KINDS)}")
    shape = tuple(meta.shape)
    box = _geometry(name, meta.dtype, shape, (tuple(meta.box.offsets), tuple(meta.box.lengths)) if meta.HasField("box") else None)
    aliases = tuple(check_tensor_name(a) for a in meta.aliases)
    if meta.frozen not in FROZEN_CLASSES:
        raise errors.InvalidRequest(f"tensor {name!r}: frozen {meta.frozen!r} is not one of {', '.join(map(repr, FROZEN_CLASSES))}")
    if meta.frozen and meta.kind != "model":
        raise errors.InvalidRequest(f"tensor {name!r}: only model tensors can be frozen, not {meta.kind} tensors")
    if meta.per_rank and (meta.kind != "extra" or aliases or box != Box.full(shape)):
        raise errors.InvalidRequest(f"tensor {name!r}: only a whole extra tensor without aliases can be a rank's own (per_rank)")
    return TensorSpec(name, meta.kind, meta.dtype, shape, box, aliases, meta.frozen, meta.per_rank)


def _geometry(name: str, dtype: str, shape: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]] | None) -> Box:
    """The Box of a tensor's `box` (offsets, lengths; None: the whole tensor) once its dtype,
    shape and box are checked; raises InvalidRequest naming the tensor."""
    if dtype not in dtypes.DTYPE_NAMES:
        raise errors.InvalidRequest(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(sorted(dtypes.DTYPE_NAMES))}")
    if len(shape) > MAX_NDIM or any(not 0 <= d <= MAX_DIM for d in shape):
        raise errors.InvalidRequest(f"tensor {name!r}: shape {list(shape)} has a negative, huge or too many dimensions")
    nbytes = math.prod(shape) * dtypes.itemsize(dtype)
    if nbytes > MAX_DIM:
        raise errors.InvalidRequest(f"tensor {name!r}: shape {list(shape)} ({human_bytes(nbytes)}) is larger than the {human_bytes(MAX_DIM)} ckptd accepts")
    if box is None:
        return Box.full(shape)
    offsets, lengths = box
    if len(offsets) != len(shape) or len(lengths) != len(shape):
        raise errors.InvalidRequest(f"tensor {name!r}: box has {len(offsets)} offsets and {len(lengths)} lengths for a {len(shape)}-dim shape")
    try:
        checked = Box(offsets, lengths)
    except ValueError as exc:
        raise errors.InvalidRequest(f"tensor {name!r}: {exc}") from None
    if not checked.fits_in(shape):
        raise errors.InvalidRequest(f"tensor {name!r}: box {checked} does not lie inside shape {list(shape)}")
    return checked


_NAME, _KIND, _DTYPE, _SHAPE = attrgetter("name"), attrgetter("kind"), attrgetter("dtype"), attrgetter("shape")
_OFFSETS, _LENGTHS, _ALIASES = attrgetter("box.offsets"), attrgetter("box.lengths"), attrgetter("aliases")
_FROZEN, _PER_RANK = attrgetter("frozen"), attrgetter("per_rank")


def _specs_by_columns(metas: Sequence[pb.TensorMeta]) -> list[TensorSpec] | None:
    """`tensor_specs` of the common request, checked column by column with C-level maps, and each
    distinct (dtype, shape, box) once (a rank's thousands of tensors have a few dozen shapes:
    one by one, about 15 µs per tensor of the event loop, paid by every rank of a restarted
    node). None when some field needs a look one by one (a per-rank tensor, a frozen one that is
    not a model tensor) or fails a check: `_tensor_spec` then names the tensor."""
    names, kinds, frozen = list(map(_NAME, metas)), list(map(_KIND, metas)), list(map(_FROZEN, metas))
    aliases = list(map(tuple, map(_ALIASES, metas)))
    if (
        not tensor_names_valid(names) or not tensor_names_valid(list(chain.from_iterable(aliases)))
        or not KINDS_SET.issuperset(kinds) or not FROZEN_SET.issuperset(frozen)
        or any(map(_PER_RANK, metas)) or any(k != "model" for k, f in zip(kinds, frozen) if f)
    ):
        return None
    dtype_of, shapes = list(map(_DTYPE, metas)), list(map(tuple, map(_SHAPE, metas)))
    boxed = list(map(pb.TensorMeta.HasField, metas, repeat("box")))
    places = list(zip(dtype_of, shapes, boxed, map(tuple, map(_OFFSETS, metas)), map(tuple, map(_LENGTHS, metas))))
    boxes: dict[tuple[Any, ...], Box] = {}
    for place in set(places):
        dtype, shape, has_box, offsets, lengths = place
        try:
            boxes[place] = _geometry("", dtype, shape, (offsets, lengths) if has_box else None)
        except errors.InvalidRequest:
            return None
    return list(map(TensorSpec, names, kinds, dtype_of, shapes, map(boxes.__getitem__, places), aliases, frozen, repeat(False)))


def check_digest(node: int, rank: int, digest: str, specs: Sequence[TensorSpec]) -> None:
    """A joining node's rank metadata is what its digest (plan.spec_digest) says: node 0 keeps
    the job's metadata and plans under it."""
    if spec_digest(specs) != digest:
        raise errors.InvalidRequest(
            f"node {node} sent metadata of rank {rank} that does not match its digest {digest[:16]!r}; "
            "every node must run the same ckptd version"
        )


def check_node(node: int, nodes: int) -> int:
    if not 0 <= node < nodes:
        raise errors.InvalidRequest(f"node {node} is not in [0, {nodes}): check --peers on every node")
    return node


def check_world_size(world_size: int) -> int:
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise errors.InvalidRequest(f"world_size {world_size} must be between 1 and {MAX_WORLD_SIZE}")
    return world_size


def check_local_world_size(local_world_size: int, world_size: int) -> int:
    """0: the daemon's default (every rank local on a single node)."""
    if not 0 <= local_world_size <= world_size:
        raise errors.InvalidRequest(f"local_world_size {local_world_size} must be between 0 and world_size={world_size}")
    return local_world_size


def check_compression(quantize: str, master_weights: str, no_quantize: bool, lineage_generation: int) -> tuple[str | None, str | None]:
    """(scheme or None, master-weights mode or None) of a BeginSave."""
    try:
        scheme = check_scheme(quantize)
        master = check_master_mode(master_weights)
    except QuantError as exc:
        raise errors.InvalidRequest(str(exc)) from None
    if no_quantize and scheme is not None:
        raise errors.InvalidRequest(f"quantize={scheme!r} and no_quantize contradict each other; send one")
    if lineage_generation < 0:
        raise errors.InvalidRequest(f"lineage_generation {lineage_generation} must be >= 0")
    return scheme, master


def check_fingerprint(fingerprint: str, required: bool = True) -> str:
    """A structure fingerprint; may be empty unless `required`."""
    if len(fingerprint) > MAX_FINGERPRINT or (required and not fingerprint):
        shape = "a non-empty string of at most" if required else "at most"
        raise errors.InvalidRequest(f"fingerprint must be {shape} {MAX_FINGERPRINT} characters")
    return fingerprint


def check_metric(metric: float, has_metric: bool) -> float | None:
    if not has_metric:
        return None
    if not math.isfinite(metric):
        raise errors.InvalidRequest(f"metric {metric} must be a finite number")
    return metric


def check_retention(message: Any, present: bool) -> JobRetention | None:
    """A job's retention request (a Retention message of either service), or None when absent."""
    if not present:
        return None
    try:
        return JobRetention(
            keep_last=message.keep_last if message.HasField("keep_last") else None,
            keep_best=message.keep_best if message.HasField("keep_best") else None,
            best_mode=message.best_mode or None,
        )
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc)) from None


def check_stall(stall_s: float) -> float:
    """The client's stall figure, for the metrics only: anything unusable counts as 0."""
    return stall_s if math.isfinite(stall_s) and 0 <= stall_s < 86400 else 0.0


def check_kinds(kinds: Sequence[str]) -> list[str]:
    for key in kinds:
        if not key or "/" in key or len(key) > 256:
            raise errors.InvalidRequest(f"top-level state key {key!r} must be a non-empty name without '/'")
    return list(kinds)


def check_known_plans(known_plans: Sequence[str]) -> Sequence[str]:
    if len(known_plans) > MAX_KNOWN_PLANS:
        raise errors.InvalidRequest(f"{len(known_plans)} known plans; send at most {MAX_KNOWN_PLANS}")
    return known_plans


def check_staged(staging_id: str, n_ranges: int) -> bool:
    """Whether a CommitSnapshot hands over staged ranges (mode ipc)."""
    if staging_id:
        if n_ranges > MAX_STAGED_RANGES:
            raise errors.InvalidRequest(f"{n_ranges} staged ranges; the limit is {MAX_STAGED_RANGES}")
        return True
    if n_ranges:
        raise errors.InvalidRequest("staged ranges without a staging_id: open a staging buffer first (OpenStaging)")
    return False


def parse_json(text: str, what: str, max_depth: int = MAX_EXTRAS_JSON_DEPTH) -> Any:
    """`text` parsed as JSON; InvalidRequest naming `what` if it is not JSON or nests deeper than
    `max_depth` (also when it nests deeper than the parser goes: no RecursionError escapes)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        too_deep = True
    else:
        too_deep = json_depth(value) > max_depth
    if too_deep:
        raise errors.InvalidRequest(f"{what} nests deeper than {max_depth} JSON levels, the limit; flatten it")
    return value


def check_model_files(model_files: Mapping[str, str]) -> dict[str, bytes]:
    """The model files (config.json ...) of a save as UTF-8 bytes: known names, at most
    MAX_MODEL_FILE_BYTES each, JSON within the depth limit."""
    out = {}
    for name, text in model_files.items():
        if name not in MODEL_FILES:
            raise errors.InvalidRequest(f"model file {name!r} is not one of {', '.join(MODEL_FILES)}")
        if len(text) > MAX_MODEL_FILE_BYTES:
            raise errors.InvalidRequest(f"model file {name} is {len(text)} bytes; the limit is {MAX_MODEL_FILE_BYTES}")
        parse_json(text, f"model file {name}")
        out[name] = text.encode()
    return out


def check_file_name(name: str, data_only: bool = True) -> str:
    """A plain file name inside a step directory (a data file unless not `data_only`)."""
    if not name or "/" in name or "\0" in name or name.startswith(".") or len(name) > 255:
        raise errors.InvalidRequest(f"{name!r} is not a file name of a step directory")
    if data_only and not name.endswith(".safetensors"):
        raise errors.InvalidRequest(f"{name!r} is not a checkpoint data file name")
    return name


def check_byte_range(name: str, size: int, offset: int, nbytes: int) -> int:
    """The number of bytes of a Fetch of [offset, +nbytes) of a `size`-byte file (nbytes 0: to the end)."""
    count = nbytes or size - offset
    if offset < 0 or count < 0 or offset + count > size:
        raise errors.InvalidRequest(f"bytes [{offset}, +{nbytes}) are outside {name} ({size} bytes)")
    return count


def check_manifest_json(node: int, fragments: Sequence[Any]) -> None:
    """The JSON fields of a node's manifest (each fragment's quantization record) within the
    depth limit: rpc_convert.manifest_from_wire trusts the parser's depth."""
    for fragment in fragments:
        if fragment.quant_json:
            parse_json(fragment.quant_json, f"the quantization record of fragment {fragment.name[:200]!r}")


MAX_REPLICA_FILES = 1 << 16
MAX_REPLICA_UNITS = 1 << 22
MAX_REPLICA_RANGES = 1 << 20


def check_replica_files(node: int, entries: Sequence[Any]) -> list[FileRecord]:
    """The data files a node offers as its part of a step (OfferReplica): plain data file names,
    each once, sizes >= 0, a checksum each."""
    if not entries or len(entries) > MAX_REPLICA_FILES:
        raise errors.InvalidRequest(f"a replica offer lists {len(entries)} files; between 1 and {MAX_REPLICA_FILES}")
    records = [FileRecord(check_file_name(e.name), e.size, e.checksum[:200], node) for e in entries]
    if len({r.name for r in records}) != len(records) or any(r.size < 0 or not r.checksum for r in records):
        raise errors.InvalidRequest("a replica offer lists a file twice, a negative size or a file without its checksum")
    return records


def check_replica_units(records: Sequence[FileRecord], entries: Sequence[Any]) -> dict[str, tuple[Unit, ...]]:
    """The checksum units of each offered file (OfferReplica's `units`): one entry per file, its
    units tiling the file's size exactly (units.tiling_problem), so that every byte that arrives
    is checked."""
    sizes = {r.name: r.size for r in records}
    if sum(len(e.units) for e in entries) > MAX_REPLICA_UNITS:
        raise errors.InvalidRequest(f"a replica offer gives more than {MAX_REPLICA_UNITS} checksum units")
    out: dict[str, tuple[Unit, ...]] = {}
    for entry in entries:
        if entry.name not in sizes or entry.name in out:
            raise errors.InvalidRequest(f"a replica offer gives checksums of {entry.name[:200]!r}, which it does not offer, or twice")
        units = tuple(Unit(u.offset, u.nbytes, u.xxh3) for u in entry.units)
        problem = tiling_problem(units, sizes[entry.name])
        if problem is not None:
            raise errors.InvalidRequest(f"the checksum units a replica offer gives for {entry.name} {problem}: they must tile the file")
        out[entry.name] = units
    lacking = sorted(set(sizes) - set(out))
    if lacking:
        raise errors.InvalidRequest(
            f"a replica offer gives no checksums of {', '.join(lacking[:3])}: a buddy checks every byte it holds (is the offering daemon older than this one?)"
        )
    return out


def check_replica_ranges(ranges: Sequence[Any]) -> list[tuple[str, int, int]]:
    """Byte ranges of replica files to read (ReadReplica): (data file name, offset >= 0, nbytes > 0)."""
    if not ranges or len(ranges) > MAX_REPLICA_RANGES:
        raise errors.InvalidRequest(f"a replica read asks for {len(ranges)} ranges; between 1 and {MAX_REPLICA_RANGES}")
    out = [(check_file_name(r.file), r.offset, r.nbytes) for r in ranges]
    if any(offset < 0 or nbytes <= 0 for _, offset, nbytes in out):
        raise errors.InvalidRequest("a replica read asks for a negative offset or an empty range")
    return out


# ------------------------------------------------------------------ whole requests (engine/requests.py)


def begin_save_of(request: pb.BeginSaveRequest) -> BeginSave:
    """A rank's BeginSave, every field checked."""
    job, rank, world_size = check_who(request.who)
    step = check_step(request.step)
    local_world_size = check_local_world_size(request.who.local_world_size, world_size)
    quantize, master_weights = check_compression(request.quantize, request.master_weights, request.no_quantize, request.lineage_generation)
    fingerprint = check_fingerprint(request.fingerprint)
    specs = tensor_specs(request.tensors) if request.tensors else None
    metric = check_metric(request.metric, request.has_metric)
    run = check_run(request.who)
    resumed_from = check_step(request.resumed_from) if request.resumed else None
    retention = check_retention(request.retention, request.HasField("retention"))
    return BeginSave(
        job, rank, world_size, step, fingerprint, specs, metric, check_timeout(request.timeout_s), local_world_size,
        SaveOptions(quantize, master_weights, request.no_quantize, retention), request.lineage_generation, run, resumed_from,
        check_client_id(request.who),
    )


def plan_load_of(request: pb.PlanLoadRequest, wanted_of: Callable[[str, int], Sequence[TensorSpec]]) -> PlanLoad:
    """A rank's PlanLoad, every field checked. wanted_of(job, rank): the tensors it wants (sent,
    or named by a fingerprint it sent before: rpc/checkpoint.py)."""
    job, rank, world_size = check_who(request.who)
    step = None if request.latest else check_step(request.step)
    wanted = wanted_of(job, rank)
    kinds = check_kinds(request.kinds)
    return PlanLoad(
        job, rank, world_size, step, wanted, kinds, request.strict, request.direct_read, request.decodes, request.decodes_frames,
        check_run(request.who), check_client_id(request.who), check_local_world_size(request.who.local_world_size, world_size),
    )


def join_save_of(request: ppb.JoinSaveRequest, nodes: int, default_timeout_s: float) -> tuple[int, JoinSave]:
    """A node's JoinSave, every field checked (its rank metadata against the digests it names,
    its options like a rank's): (the joining node, its request). default_timeout_s: the join
    window of a request without one."""
    job = check_job_id(request.job)
    step = check_step(request.step)
    node = check_node(request.node, nodes)
    world_size = check_world_size(request.world_size)
    if not request.fingerprints:
        raise errors.InvalidRequest(f"node {node} joined the save of step {step} without ranks")
    specs = {}
    for entry in request.tensors:
        if request.fingerprints.get(entry.rank) != entry.fingerprint:
            raise errors.InvalidRequest(f"metadata of rank {entry.rank} does not match its fingerprint")
        specs[entry.rank] = tuple(tensor_specs(entry.tensors))
        check_digest(node, entry.rank, entry.fingerprint, specs[entry.rank])
    timeout_s = check_timeout(request.timeout_s) or default_timeout_s
    metric = request.metric if request.has_metric else None
    try:
        quantize = check_scheme(request.quantize or None)
        master = check_master_mode(request.master_weights or None)
    except ValueError as exc:
        raise errors.InvalidRequest(f"node {request.node}: {exc}") from None
    options = SaveOptions(quantize, master, request.no_quantize, check_retention(request.retention, request.HasField("retention")))
    claim = RunClaim(check_run_id(request.run_id), request.resumed) if request.run_id else NO_CLAIM
    joined = JoinSave(
        job, step, world_size, dict(request.fingerprints), specs, tuple(request.known_plans), timeout_s, metric, options, max(0, request.lineage), claim
    )
    return node, joined
