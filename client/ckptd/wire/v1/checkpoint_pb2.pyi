from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Box(_message.Message):
    __slots__ = ("offsets", "lengths")
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "kind", "dtype", "shape", "box", "aliases", "frozen", "per_rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    box: Box
    aliases: _containers.RepeatedScalarFieldContainer[str]
    frozen: str
    per_rank: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., box: _Optional[_Union[Box, _Mapping]] = ..., aliases: _Optional[_Iterable[str]] = ..., frozen: _Optional[str] = ..., per_rank: _Optional[bool] = ...) -> None: ...

class RankId(_message.Message):
    __slots__ = ("job", "rank", "world_size", "local_world_size", "run_id", "client_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    local_world_size: int
    run_id: str
    client_id: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_world_size: _Optional[int] = ..., run_id: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class BeginSaveRequest(_message.Message):
    __slots__ = ("who", "step", "fingerprint", "tensors", "quantize", "metric", "has_metric", "timeout_s", "master_weights", "lineage_generation", "no_quantize", "known_layout", "resumed", "resumed_from", "retention")
    WHO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    HAS_METRIC_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MASTER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    NO_QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    step: int
    fingerprint: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    quantize: str
    metric: float
    has_metric: bool
    timeout_s: float
    master_weights: str
    lineage_generation: int
    no_quantize: bool
    known_layout: str
    resumed: bool
    resumed_from: int
    retention: Retention
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., step: _Optional[int] = ..., fingerprint: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., quantize: _Optional[str] = ..., metric: _Optional[float] = ..., has_metric: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., master_weights: _Optional[str] = ..., lineage_generation: _Optional[int] = ..., no_quantize: _Optional[bool] = ..., known_layout: _Optional[str] = ..., resumed: _Optional[bool] = ..., resumed_from: _Optional[int] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("keep_last", "keep_best", "best_mode")
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    KEEP_BEST_FIELD_NUMBER: _ClassVar[int]
    BEST_MODE_FIELD_NUMBER: _ClassVar[int]
    keep_last: int
    keep_best: int
    best_mode: str
    def __init__(self, keep_last: _Optional[int] = ..., keep_best: _Optional[int] = ..., best_mode: _Optional[str] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("name", "offset", "nbytes", "box", "kind", "dtype", "shape", "aliases")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    nbytes: int
    box: Box
    kind: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., box: _Optional[_Union[Box, _Mapping]] = ..., kind: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class BeginSaveResponse(_message.Message):
    __slots__ = ("save_id", "skipped", "skip_reason", "arena_path", "arena_size", "slots", "layout_id", "committed")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SKIP_REASON_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    skipped: bool
    skip_reason: str
    arena_path: str
    arena_size: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    layout_id: str
    committed: bool
    def __init__(self, save_id: _Optional[str] = ..., skipped: _Optional[bool] = ..., skip_reason: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_size: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., layout_id: _Optional[str] = ..., committed: _Optional[bool] = ...) -> None: ...

class CommitSnapshotRequest(_message.Message):
    __slots__ = ("who", "save_id", "extras_json", "model_files", "stall_s", "staging_id", "staged")
    class ModelFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WHO_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FILES_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    STAGING_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    save_id: str
    extras_json: str
    model_files: _containers.ScalarMap[str, str]
    stall_s: float
    staging_id: str
    staged: _containers.RepeatedCompositeFieldContainer[StagedRange]
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., save_id: _Optional[str] = ..., extras_json: _Optional[str] = ..., model_files: _Optional[_Mapping[str, str]] = ..., stall_s: _Optional[float] = ..., staging_id: _Optional[str] = ..., staged: _Optional[_Iterable[_Union[StagedRange, _Mapping]]] = ...) -> None: ...

class StagedRange(_message.Message):
    __slots__ = ("staging_offset", "arena_offset", "nbytes")
    STAGING_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ARENA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    staging_offset: int
    arena_offset: int
    nbytes: int
    def __init__(self, staging_offset: _Optional[int] = ..., arena_offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CommitSnapshotResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenStagingRequest(_message.Message):
    __slots__ = ("who", "gpu_uuid", "ipc_handle", "nbytes", "pid")
    WHO_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    gpu_uuid: str
    ipc_handle: bytes
    nbytes: int
    pid: int
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., gpu_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class OpenStagingResponse(_message.Message):
    __slots__ = ("staging_id", "reason")
    STAGING_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    staging_id: str
    reason: str
    def __init__(self, staging_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CloseStagingRequest(_message.Message):
    __slots__ = ("who", "staging_id")
    WHO_FIELD_NUMBER: _ClassVar[int]
    STAGING_ID_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    staging_id: str
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., staging_id: _Optional[str] = ...) -> None: ...

class CloseStagingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("who", "save_id", "reason")
    WHO_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    save_id: str
    reason: str
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., save_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortSaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitDurableRequest(_message.Message):
    __slots__ = ("job", "step", "timeout_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    timeout_s: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SaveProgress(_message.Message):
    __slots__ = ("state", "bytes_total", "bytes_written", "done", "error", "step_dir", "bytes_linked")
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_DIR_FIELD_NUMBER: _ClassVar[int]
    BYTES_LINKED_FIELD_NUMBER: _ClassVar[int]
    state: str
    bytes_total: int
    bytes_written: int
    done: bool
    error: str
    step_dir: str
    bytes_linked: int
    def __init__(self, state: _Optional[str] = ..., bytes_total: _Optional[int] = ..., bytes_written: _Optional[int] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ..., step_dir: _Optional[str] = ..., bytes_linked: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("who", "pid", "host")
    WHO_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    pid: int
    host: str
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("owner_run",)
    OWNER_RUN_FIELD_NUMBER: _ClassVar[int]
    owner_run: str
    def __init__(self, owner_run: _Optional[str] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("who",)
    WHO_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanLoadRequest(_message.Message):
    __slots__ = ("who", "step", "latest", "tensors", "kinds", "strict", "direct_read", "decodes", "decodes_frames", "fingerprint", "known_plans", "memory_columns")
    WHO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    DIRECT_READ_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    DECODES_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KNOWN_PLANS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    step: int
    latest: bool
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    kinds: _containers.RepeatedScalarFieldContainer[str]
    strict: bool
    direct_read: bool
    decodes: bool
    decodes_frames: bool
    fingerprint: str
    known_plans: _containers.RepeatedScalarFieldContainer[str]
    memory_columns: bool
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., step: _Optional[int] = ..., latest: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., kinds: _Optional[_Iterable[str]] = ..., strict: _Optional[bool] = ..., direct_read: _Optional[bool] = ..., decodes: _Optional[bool] = ..., decodes_frames: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., known_plans: _Optional[_Iterable[str]] = ..., memory_columns: _Optional[bool] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("name", "source", "path", "offset", "nbytes", "fragment", "dtype", "checksum", "chunk_bytes", "chunk_xxh3", "decode")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_XXH3_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    path: str
    offset: int
    nbytes: int
    fragment: Box
    dtype: str
    checksum: str
    chunk_bytes: int
    chunk_xxh3: str
    decode: Decode
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., fragment: _Optional[_Union[Box, _Mapping]] = ..., dtype: _Optional[str] = ..., checksum: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., chunk_xxh3: _Optional[str] = ..., decode: _Optional[_Union[Decode, _Mapping]] = ...) -> None: ...

class Decode(_message.Message):
    __slots__ = ("codec", "block", "scales", "base", "frame_rows", "frame_ends")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    FRAME_ROWS_FIELD_NUMBER: _ClassVar[int]
    FRAME_ENDS_FIELD_NUMBER: _ClassVar[int]
    codec: str
    block: int
    scales: Piece
    base: Piece
    frame_rows: int
    frame_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, codec: _Optional[str] = ..., block: _Optional[int] = ..., scales: _Optional[_Union[Piece, _Mapping]] = ..., base: _Optional[_Union[Piece, _Mapping]] = ..., frame_rows: _Optional[int] = ..., frame_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanLoadResponse(_message.Message):
    __slots__ = ("load_id", "step", "pieces", "extras_json", "missing", "unexpected", "tier", "generation", "plan_id", "columns")
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_JSON_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    UNEXPECTED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    load_id: str
    step: int
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    extras_json: str
    missing: _containers.RepeatedScalarFieldContainer[str]
    unexpected: _containers.RepeatedScalarFieldContainer[str]
    tier: str
    generation: int
    plan_id: str
    columns: MemoryColumns
    def __init__(self, load_id: _Optional[str] = ..., step: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., extras_json: _Optional[str] = ..., missing: _Optional[_Iterable[str]] = ..., unexpected: _Optional[_Iterable[str]] = ..., tier: _Optional[str] = ..., generation: _Optional[int] = ..., plan_id: _Optional[str] = ..., columns: _Optional[_Union[MemoryColumns, _Mapping]] = ...) -> None: ...

class MemoryColumns(_message.Message):
    __slots__ = ("paths", "file", "offset", "nbytes")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    file: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    nbytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., file: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., nbytes: _Optional[_Iterable[int]] = ...) -> None: ...

class HeldArenaRequest(_message.Message):
    __slots__ = ("who",)
    WHO_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ...) -> None: ...

class HeldArenaResponse(_message.Message):
    __slots__ = ("step", "path", "nbytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    nbytes: int
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class LoadDoneRequest(_message.Message):
    __slots__ = ("who", "load_id")
    WHO_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    who: RankId
    load_id: str
    def __init__(self, who: _Optional[_Union[RankId, _Mapping]] = ..., load_id: _Optional[str] = ...) -> None: ...

class LoadDoneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("step", "created_at", "size_bytes", "file_count", "path", "in_memory", "metric", "has_metric")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    HAS_METRIC_FIELD_NUMBER: _ClassVar[int]
    step: int
    created_at: float
    size_bytes: int
    file_count: int
    path: str
    in_memory: bool
    metric: float
    has_metric: bool
    def __init__(self, step: _Optional[int] = ..., created_at: _Optional[float] = ..., size_bytes: _Optional[int] = ..., file_count: _Optional[int] = ..., path: _Optional[str] = ..., in_memory: _Optional[bool] = ..., metric: _Optional[float] = ..., has_metric: _Optional[bool] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("job", "step", "state", "bytes_total", "bytes_written", "age_s", "ranks_arrived", "ranks_expected", "write_s", "bytes_linked")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_ARRIVED_FIELD_NUMBER: _ClassVar[int]
    RANKS_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    WRITE_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_LINKED_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    state: str
    bytes_total: int
    bytes_written: int
    age_s: float
    ranks_arrived: int
    ranks_expected: int
    write_s: float
    bytes_linked: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., state: _Optional[str] = ..., bytes_total: _Optional[int] = ..., bytes_written: _Optional[int] = ..., age_s: _Optional[float] = ..., ranks_arrived: _Optional[int] = ..., ranks_expected: _Optional[int] = ..., write_s: _Optional[float] = ..., bytes_linked: _Optional[int] = ...) -> None: ...

class LastCommit(_message.Message):
    __slots__ = ("job", "step", "committed_at", "latency_s", "bytes", "step_dir")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_DIR_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    committed_at: float
    latency_s: float
    bytes: int
    step_dir: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., committed_at: _Optional[float] = ..., latency_s: _Optional[float] = ..., bytes: _Optional[int] = ..., step_dir: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "root", "in_flight", "arena_bytes", "arena_count", "committed_total", "failed_total", "skipped_total", "last_error", "draining", "queue_depth", "last_commit", "node_rank", "nodes", "bytes_written_total", "uptime_s", "loads_active", "remote", "replicas", "link_mismatches_total", "arena_holders", "shm_budget", "shm_free", "shm_staging")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LOADS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LINK_MISMATCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ARENA_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    SHM_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHM_FREE_FIELD_NUMBER: _ClassVar[int]
    SHM_STAGING_FIELD_NUMBER: _ClassVar[int]
    version: str
    root: str
    in_flight: _containers.RepeatedCompositeFieldContainer[InFlight]
    arena_bytes: int
    arena_count: int
    committed_total: int
    failed_total: int
    skipped_total: int
    last_error: str
    draining: bool
    queue_depth: int
    last_commit: LastCommit
    node_rank: int
    nodes: int
    bytes_written_total: int
    uptime_s: float
    loads_active: int
    remote: RemoteStatus
    replicas: ReplicaStatus
    link_mismatches_total: int
    arena_holders: _containers.RepeatedCompositeFieldContainer[ArenaHolder]
    shm_budget: int
    shm_free: int
    shm_staging: int
    def __init__(self, version: _Optional[str] = ..., root: _Optional[str] = ..., in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ..., arena_bytes: _Optional[int] = ..., arena_count: _Optional[int] = ..., committed_total: _Optional[int] = ..., failed_total: _Optional[int] = ..., skipped_total: _Optional[int] = ..., last_error: _Optional[str] = ..., draining: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., last_commit: _Optional[_Union[LastCommit, _Mapping]] = ..., node_rank: _Optional[int] = ..., nodes: _Optional[int] = ..., bytes_written_total: _Optional[int] = ..., uptime_s: _Optional[float] = ..., loads_active: _Optional[int] = ..., remote: _Optional[_Union[RemoteStatus, _Mapping]] = ..., replicas: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., link_mismatches_total: _Optional[int] = ..., arena_holders: _Optional[_Iterable[_Union[ArenaHolder, _Mapping]]] = ..., shm_budget: _Optional[int] = ..., shm_free: _Optional[int] = ..., shm_staging: _Optional[int] = ...) -> None: ...

class ArenaHolder(_message.Message):
    __slots__ = ("job", "bytes", "sets", "held_steps", "in_flight", "readers", "idle_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SETS_FIELD_NUMBER: _ClassVar[int]
    HELD_STEPS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    bytes: int
    sets: int
    held_steps: _containers.RepeatedScalarFieldContainer[int]
    in_flight: int
    readers: int
    idle_s: float
    def __init__(self, job: _Optional[str] = ..., bytes: _Optional[int] = ..., sets: _Optional[int] = ..., held_steps: _Optional[_Iterable[int]] = ..., in_flight: _Optional[int] = ..., readers: _Optional[int] = ..., idle_s: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("held_bytes", "memory_limit", "held", "jobs", "bulk_port")
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    held_bytes: int
    memory_limit: int
    held: _containers.RepeatedCompositeFieldContainer[HeldReplica]
    jobs: _containers.RepeatedCompositeFieldContainer[JobReplicas]
    bulk_port: BulkPort
    def __init__(self, held_bytes: _Optional[int] = ..., memory_limit: _Optional[int] = ..., held: _Optional[_Iterable[_Union[HeldReplica, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobReplicas, _Mapping]]] = ..., bulk_port: _Optional[_Union[BulkPort, _Mapping]] = ...) -> None: ...

class BulkPort(_message.Message):
    __slots__ = ("port", "healthy", "problem", "accept_errors", "refused", "opening")
    PORT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    OPENING_FIELD_NUMBER: _ClassVar[int]
    port: int
    healthy: bool
    problem: str
    accept_errors: int
    refused: int
    opening: int
    def __init__(self, port: _Optional[int] = ..., healthy: _Optional[bool] = ..., problem: _Optional[str] = ..., accept_errors: _Optional[int] = ..., refused: _Optional[int] = ..., opening: _Optional[int] = ...) -> None: ...

class HeldReplica(_message.Message):
    __slots__ = ("job", "node", "step", "bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: int
    step: int
    bytes: int
    def __init__(self, job: _Optional[str] = ..., node: _Optional[int] = ..., step: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class JobReplicas(_message.Message):
    __slots__ = ("job", "pushed_step", "holders", "push_error", "pushing", "recoverable_step", "not_recoverable")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PUSHED_STEP_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ERROR_FIELD_NUMBER: _ClassVar[int]
    PUSHING_FIELD_NUMBER: _ClassVar[int]
    RECOVERABLE_STEP_FIELD_NUMBER: _ClassVar[int]
    NOT_RECOVERABLE_FIELD_NUMBER: _ClassVar[int]
    job: str
    pushed_step: int
    holders: _containers.RepeatedScalarFieldContainer[int]
    push_error: str
    pushing: bool
    recoverable_step: int
    not_recoverable: str
    def __init__(self, job: _Optional[str] = ..., pushed_step: _Optional[int] = ..., holders: _Optional[_Iterable[int]] = ..., push_error: _Optional[str] = ..., pushing: _Optional[bool] = ..., recoverable_step: _Optional[int] = ..., not_recoverable: _Optional[str] = ...) -> None: ...

class RemoteStatus(_message.Message):
    __slots__ = ("location", "endpoint", "state", "uploaded_steps", "uploaded_bytes", "copied_bytes", "failures", "pending_steps", "lag_s", "last_uploaded", "last_error", "restored_steps", "restored_bytes")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_STEPS_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    PENDING_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    LAST_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    location: str
    endpoint: str
    state: str
    uploaded_steps: int
    uploaded_bytes: int
    copied_bytes: int
    failures: int
    pending_steps: int
    lag_s: float
    last_uploaded: str
    last_error: str
    restored_steps: int
    restored_bytes: int
    def __init__(self, location: _Optional[str] = ..., endpoint: _Optional[str] = ..., state: _Optional[str] = ..., uploaded_steps: _Optional[int] = ..., uploaded_bytes: _Optional[int] = ..., copied_bytes: _Optional[int] = ..., failures: _Optional[int] = ..., pending_steps: _Optional[int] = ..., lag_s: _Optional[float] = ..., last_uploaded: _Optional[str] = ..., last_error: _Optional[str] = ..., restored_steps: _Optional[int] = ..., restored_bytes: _Optional[int] = ...) -> None: ...

class CollectRequest(_message.Message):
    __slots__ = ("job", "dry_run")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    job: str
    dry_run: bool
    def __init__(self, job: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class Removed(_message.Message):
    __slots__ = ("job", "step", "path", "reason", "bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    path: str
    reason: str
    bytes: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class CollectResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedCompositeFieldContainer[Removed]
    def __init__(self, removed: _Optional[_Iterable[_Union[Removed, _Mapping]]] = ...) -> None: ...
