from ckptd.wire.v1 import checkpoint_pb2 as _checkpoint_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankTensors(_message.Message):
    __slots__ = ("rank", "fingerprint", "tensors")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    fingerprint: str
    tensors: _containers.RepeatedCompositeFieldContainer[_checkpoint_pb2.TensorMeta]
    def __init__(self, rank: _Optional[int] = ..., fingerprint: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_checkpoint_pb2.TensorMeta, _Mapping]]] = ...) -> None: ...

class JoinSaveRequest(_message.Message):
    __slots__ = ("job", "step", "node", "world_size", "fingerprints", "tensors", "known_plans", "timeout_s", "metric", "has_metric", "root_id", "quantize", "master_weights", "no_quantize", "lineage", "run_id", "resumed", "retention")
    class FingerprintsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_PLANS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    HAS_METRIC_FIELD_NUMBER: _ClassVar[int]
    ROOT_ID_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NO_QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    node: int
    world_size: int
    fingerprints: _containers.ScalarMap[int, str]
    tensors: _containers.RepeatedCompositeFieldContainer[RankTensors]
    known_plans: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    metric: float
    has_metric: bool
    root_id: str
    quantize: str
    master_weights: str
    no_quantize: bool
    lineage: int
    run_id: str
    resumed: bool
    retention: _checkpoint_pb2.Retention
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., node: _Optional[int] = ..., world_size: _Optional[int] = ..., fingerprints: _Optional[_Mapping[int, str]] = ..., tensors: _Optional[_Iterable[_Union[RankTensors, _Mapping]]] = ..., known_plans: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ..., metric: _Optional[float] = ..., has_metric: _Optional[bool] = ..., root_id: _Optional[str] = ..., quantize: _Optional[str] = ..., master_weights: _Optional[str] = ..., no_quantize: _Optional[bool] = ..., lineage: _Optional[int] = ..., run_id: _Optional[str] = ..., resumed: _Optional[bool] = ..., retention: _Optional[_Union[_checkpoint_pb2.Retention, _Mapping]] = ...) -> None: ...

class Compression(_message.Message):
    __slots__ = ("quantize", "master_weights", "recorded", "generation")
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    quantize: str
    master_weights: str
    recorded: bool
    generation: int
    def __init__(self, quantize: _Optional[str] = ..., master_weights: _Optional[str] = ..., recorded: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class JoinSaveResponse(_message.Message):
    __slots__ = ("save_id", "plan_key", "node_of_rank", "tensors", "shared_root", "compression")
    class NodeOfRankEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_OF_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHARED_ROOT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    plan_key: str
    node_of_rank: _containers.ScalarMap[int, int]
    tensors: _containers.RepeatedCompositeFieldContainer[RankTensors]
    shared_root: bool
    compression: Compression
    def __init__(self, save_id: _Optional[str] = ..., plan_key: _Optional[str] = ..., node_of_rank: _Optional[_Mapping[int, int]] = ..., tensors: _Optional[_Iterable[_Union[RankTensors, _Mapping]]] = ..., shared_root: _Optional[bool] = ..., compression: _Optional[_Union[Compression, _Mapping]] = ...) -> None: ...

class FileEntry(_message.Message):
    __slots__ = ("name", "size", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    checksum: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class StoredFragment(_message.Message):
    __slots__ = ("name", "file", "key", "box", "dtype", "offset", "nbytes", "checksum", "chunk_bytes", "chunk_xxh3", "quant_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_XXH3_FIELD_NUMBER: _ClassVar[int]
    QUANT_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    file: str
    key: str
    box: _checkpoint_pb2.Box
    dtype: str
    offset: int
    nbytes: int
    checksum: str
    chunk_bytes: int
    chunk_xxh3: str
    quant_json: str
    def __init__(self, name: _Optional[str] = ..., file: _Optional[str] = ..., key: _Optional[str] = ..., box: _Optional[_Union[_checkpoint_pb2.Box, _Mapping]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., chunk_xxh3: _Optional[str] = ..., quant_json: _Optional[str] = ...) -> None: ...

class ReportManifestRequest(_message.Message):
    __slots__ = ("job", "step", "save_id", "node", "ok", "error", "files", "fragments", "extras_json", "model_files")
    class ExtrasJsonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class ModelFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FILES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    save_id: str
    node: int
    ok: bool
    error: str
    files: _containers.RepeatedCompositeFieldContainer[FileEntry]
    fragments: _containers.RepeatedCompositeFieldContainer[StoredFragment]
    extras_json: _containers.ScalarMap[int, str]
    model_files: _containers.ScalarMap[str, str]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., save_id: _Optional[str] = ..., node: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., files: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ..., fragments: _Optional[_Iterable[_Union[StoredFragment, _Mapping]]] = ..., extras_json: _Optional[_Mapping[int, str]] = ..., model_files: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ReportManifestResponse(_message.Message):
    __slots__ = ("committed", "error", "step_files")
    class StepFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FILES_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    error: str
    step_files: _containers.ScalarMap[str, bytes]
    def __init__(self, committed: _Optional[bool] = ..., error: _Optional[str] = ..., step_files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("job", "step", "newest", "run_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    newest: bool
    run_id: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., newest: _Optional[bool] = ..., run_id: _Optional[str] = ...) -> None: ...

class ReplicaFile(_message.Message):
    __slots__ = ("node", "name", "size")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    node: int
    name: str
    size: int
    def __init__(self, node: _Optional[int] = ..., name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class InventoryResponse(_message.Message):
    __slots__ = ("root_id", "committed", "files", "in_flight", "replicas", "newest_step", "run_attached", "loading")
    ROOT_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_STEP_FIELD_NUMBER: _ClassVar[int]
    RUN_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    root_id: str
    committed: bool
    files: _containers.RepeatedCompositeFieldContainer[FileEntry]
    in_flight: bool
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaFile]
    newest_step: int
    run_attached: bool
    loading: bool
    def __init__(self, root_id: _Optional[str] = ..., committed: _Optional[bool] = ..., files: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ..., in_flight: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[ReplicaFile, _Mapping]]] = ..., newest_step: _Optional[int] = ..., run_attached: _Optional[bool] = ..., loading: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("job", "step", "file", "offset", "nbytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    file: str
    offset: int
    nbytes: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class OfferReplicaRequest(_message.Message):
    __slots__ = ("job", "step", "node", "files", "units")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    node: int
    files: _containers.RepeatedCompositeFieldContainer[FileEntry]
    units: _containers.RepeatedCompositeFieldContainer[FileUnits]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., node: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ..., units: _Optional[_Iterable[_Union[FileUnits, _Mapping]]] = ...) -> None: ...

class ChecksumUnit(_message.Message):
    __slots__ = ("offset", "nbytes", "xxh3")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    xxh3: int
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., xxh3: _Optional[int] = ...) -> None: ...

class FileUnits(_message.Message):
    __slots__ = ("name", "units")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    units: _containers.RepeatedCompositeFieldContainer[ChecksumUnit]
    def __init__(self, name: _Optional[str] = ..., units: _Optional[_Iterable[_Union[ChecksumUnit, _Mapping]]] = ...) -> None: ...

class ReplicaRange(_message.Message):
    __slots__ = ("file", "offset", "nbytes")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    nbytes: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ReadReplicaRequest(_message.Message):
    __slots__ = ("job", "step", "node", "ranges")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    node: int
    ranges: _containers.RepeatedCompositeFieldContainer[ReplicaRange]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., node: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[ReplicaRange, _Mapping]]] = ...) -> None: ...

class BulkTicket(_message.Message):
    __slots__ = ("accepted", "reason", "held", "port", "ticket")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    held: bool
    port: int
    ticket: bytes
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., held: _Optional[bool] = ..., port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class ReplicaHeldRequest(_message.Message):
    __slots__ = ("job", "step", "node", "holders", "error")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    node: int
    holders: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., node: _Optional[int] = ..., holders: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class ReplicaHeldResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeldPartsRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: int
    def __init__(self, node: _Optional[int] = ...) -> None: ...

class HeldPart(_message.Message):
    __slots__ = ("job", "step", "holders")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    holders: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., holders: _Optional[_Iterable[int]] = ...) -> None: ...

class HeldPartsResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[HeldPart]
    def __init__(self, parts: _Optional[_Iterable[_Union[HeldPart, _Mapping]]] = ...) -> None: ...
