"""The daemon's wire conversions (rpc_convert): records survive the round trip through their
messages, and what a peer sends is validated where it becomes a record."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import pytest

from ckptd.common.boxes import Box
from ckptd.common.frames import Frames
from ckptd.daemon.engine.requests import JoinSave, ReportManifest
from ckptd.daemon.engine.runs import RunClaim
from ckptd.daemon.plan.retention import JobRetention
from ckptd.daemon.rpc import convert as rpc_convert
from ckptd.daemon.rpc import validate
from ckptd.daemon.plan.compression import Compression, SaveOptions
from ckptd.daemon.errors import Aborted, InvalidRequest
from ckptd.format.index import FileRecord, FragmentRecord, QuantRecord, SideRecord
from ckptd.daemon.plan.files import NodeManifest
from ckptd.daemon.plan.load_plan import LoadPlan
from ckptd.daemon.plan.save_plan import TensorSpec, make_save_plan, spec_digest
from ckptd.daemon.records import InFlightSave, JoinResult, LastCommit, Outcome, PeerInventory, StatusSnapshot
from ckptd.format.file_plan import DecodeInfo, PieceInfo
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import peer_pb2 as ppb

HALVES = [Box((0, 0), (2, 2)), Box((2, 0), (2, 2))]


def specs(box: Box) -> tuple[TensorSpec, ...]:
    return (TensorSpec("model/w", "model", "F32", (4, 2), box, ("model/tied",)), TensorSpec("optimizer/step", "optimizer", "I64", (), Box.full(())))


def test_a_join_crosses_the_wire_unchanged_both_ways() -> None:
    result = JoinResult("save-1", "key", (0, 1), (specs(HALVES[0]), specs(HALVES[1])), True, fingerprints=("fa", "fb"))
    assert rpc_convert.join_result_of(rpc_convert.join_response(result), 2) == result
    known = JoinResult("save-2", "key", (0, 0), None, False)  # a known plan: its key covers the metadata and the nodes, neither travels
    assert rpc_convert.join_result_of(rpc_convert.join_response(known), 2) == replace(known, node_of_rank=())
    assert not rpc_convert.join_response(known).node_of_rank
    request = rpc_convert.join_request(JoinSave("job", 3, 2, {1: "fp"}, {1: specs(HALVES[1])}, ("k",), 9.5, None), 1, "root")
    assert (request.node, dict(request.fingerprints), request.has_metric, request.root_id) == (1, {1: "fp"}, False, "root")
    assert [m.name for m in request.tensors[0].tensors] == ["model/w", "optimizer/step"] and list(request.tensors[0].tensors[0].aliases) == ["model/tied"]
    assert rpc_convert.join_request(JoinSave("job", 3, 2, {1: "fp"}, {}, (), 1.0, 0.0), 1, "r").has_metric  # a metric of 0 is a metric


@pytest.mark.parametrize(
    "joining",
    [
        JoinSave("job", 3, 2, {1: spec_digest(specs(HALVES[1]))}, {1: specs(HALVES[1])}, ("k",), 9.5, None),
        JoinSave("job", 3, 2, {0: "fa", 1: "fb"}, {}, (), 1.0, 0.0, SaveOptions("O2", "drop", False, JobRetention(keep_last=2)), 4, RunClaim("run1", True)),
        JoinSave("job", 0, 1, {0: "f"}, {}, ("k1", "k2"), 3.0, 1.5, SaveOptions(None, None, True), 0, RunClaim("run2")),
    ],
)
def test_a_join_request_crosses_the_wire_unchanged(joining: JoinSave) -> None:
    node, back = validate.join_save_of(rpc_convert.join_request(joining, 1, "root"), nodes=2, default_timeout_s=60.0)
    assert (node, back) == (1, joining)


def test_replicas_metadata_crosses_once_and_arrives_for_every_rank() -> None:
    """Data-parallel replicas (equal fingerprints) are sent as the fingerprint alone: the answer
    grows with the distinct layouts, not with the ranks (issue 23's scale simulation)."""
    a, b = specs(HALVES[0]), specs(HALVES[1])
    world = (a, b, a, b, a, b)  # 3 replicas of a 2-way split
    result = JoinResult("s", "k", (0, 0, 1, 1, 2, 2), world, True, fingerprints=("fa", "fb") * 3)
    reply = rpc_convert.join_response(result)
    assert [len(t.tensors) for t in reply.tensors] == [2, 2, 0, 0, 0, 0]
    assert [t.fingerprint for t in reply.tensors] == ["fa", "fb"] * 3
    back = rpc_convert.join_result_of(reply, 6)
    assert back.specs == world and back.node_of_rank == (0, 0, 1, 1, 2, 2)
    assert back.specs is not None and back.specs[0] is back.specs[2] is back.specs[4]  # one object per layout: planned once (issue 34)
    empty = JoinResult("s", "k", (0, 0), ((), ()), True, fingerprints=("f0", "f0"))  # ranks without tensors stay empty
    assert rpc_convert.join_result_of(rpc_convert.join_response(empty), 2).specs == ((), ())


def test_the_coordinators_metadata_is_validated_and_must_cover_every_rank() -> None:
    short = rpc_convert.join_response(JoinResult("s", "k", (0, 1), (specs(HALVES[0]), specs(HALVES[1])), True))
    del short.tensors[1]
    with pytest.raises(Aborted, match=r"metadata for ranks \[0\], expected 0..1"):
        rpc_convert.join_result_of(short, 2)
    nodes_short = rpc_convert.join_response(JoinResult("s", "k", (0, 1), (specs(HALVES[0]), specs(HALVES[1])), True))
    del nodes_short.node_of_rank[1]
    with pytest.raises(Aborted, match="the nodes of 1 ranks"):
        rpc_convert.join_result_of(nodes_short, 2)
    bad = rpc_convert.join_response(JoinResult("s", "k", (0,), (specs(HALVES[0]),), True))
    bad.tensors[0].tensors[0].dtype = "F99"
    with pytest.raises(InvalidRequest, match="dtype 'F99'"):
        rpc_convert.join_result_of(bad, 1)


def test_a_report_carries_the_manifest_and_model_files() -> None:
    quant = QuantRecord("lin-i8", 32, SideRecord("f.safetensors", "w.scales", "F32", (4, 1), 200, 16, "xxh3-64:2"), None, Frames(2, (10, 20)))
    manifest = NodeManifest(
        1,
        (FileRecord("model-00002-of-00002.safetensors", 100, "xxh3-64:0", 1),),
        (("model/w", FragmentRecord("model-00002-of-00002.safetensors", "w@2,0", HALVES[1], "I8", 84, 16, "xxh3-64:1", 65536, "ab", quant)),),
    )
    request = rpc_convert.report_request(ReportManifest("job", 3, "save", manifest, "", {0: {}}, {"config.json": b"{}"}), 1)
    assert request.ok and dict(request.model_files) == {"config.json": "{}"} and dict(request.extras_json) == {0: "{}"}
    assert rpc_convert.manifest_from_wire(1, request.files, request.fragments) == manifest
    failed = rpc_convert.report_request(ReportManifest("job", 3, "save", None, "disk full"), 1)
    assert not failed.ok and not failed.files and failed.error == "disk full"


@pytest.mark.parametrize(("quant_json", "message"), [('{"block": 1}', "malformed quantization record"), ("{", "malformed"), ("[1]", "malformed")])
def test_a_malformed_quantization_record_is_invalid(quant_json: str, message: str) -> None:
    fragment = ppb.StoredFragment(name="model/w", file="f.safetensors", quant_json=quant_json)
    with pytest.raises(InvalidRequest, match=message):
        rpc_convert.manifest_from_wire(2, [], [fragment])


@pytest.mark.parametrize(
    "compression", [None, Compression(None, "keep", 0, False), Compression("O2", "drop", 3, True), Compression(None, "keep", 1, True)]
)
def test_the_coordinators_compression_crosses_the_wire_unchanged(compression: Compression | None) -> None:
    result = JoinResult("s", "k", (), None, True, compression)
    assert rpc_convert.join_result_of(rpc_convert.join_response(result), 1) == result


def test_a_node_refuses_a_compression_it_cannot_write() -> None:
    reply = rpc_convert.join_response(JoinResult("s", "k", (0,), None, True, Compression("O1", "keep", 1, True)))
    reply.compression.quantize = "O9"
    with pytest.raises(InvalidRequest, match="the coordinator decided a compression this node cannot write: quantize='O9'"):
        rpc_convert.join_result_of(reply, 1)


def test_a_joining_nodes_options_are_checked_like_a_ranks() -> None:
    request = rpc_convert.join_request(JoinSave("j", 1, 2, {1: "f"}, {}, (), 10.0, None, SaveOptions("O2", "drop", False), 4), 1, "r")
    _, joining = validate.join_save_of(request, nodes=2, default_timeout_s=60.0)
    assert joining.options == SaveOptions("O2", "drop", False) and joining.lineage == 4
    request.master_weights = "shred"
    with pytest.raises(InvalidRequest, match="node 1: master_weights='shred'"):
        validate.join_save_of(request, nodes=2, default_timeout_s=60.0)
    request.timeout_s, request.master_weights = 0.0, ""
    assert validate.join_save_of(request, nodes=2, default_timeout_s=60.0)[1].timeout_s == 60.0  # none given: the daemon's


def test_an_outcome_and_an_inventory_cross_the_wire_unchanged() -> None:
    outcome = Outcome(True, "", {"ckptd.index.json": b"{...}"})
    assert rpc_convert.outcome_of(rpc_convert.report_response(outcome)) == outcome
    inventory = PeerInventory("root", True, {"a.safetensors": 10, "b.safetensors": 20}, False)
    back = rpc_convert.inventory_of(rpc_convert.inventory_response(inventory))
    assert back == inventory and back.sizes == inventory.sizes
    assert (back.committed, back.sizes, back.in_flight, back.root_id) == (True, inventory.sizes, False, "root")
    held = PeerInventory("root", True, {}, False, replicas=((2, "a.safetensors", 10),), newest=7)  # tier 0b
    assert rpc_convert.inventory_of(rpc_convert.inventory_response(held)) == held


def test_a_piece_with_its_decoding_side_pieces() -> None:
    scales = PieceInfo("w.scales", "file", "/r/f", 200, 16, HALVES[0], "F32", "xxh3-64:2")
    piece = PieceInfo("w", "file", "/r/f", 84, 16, HALVES[0], "I8", "xxh3-64:1", 65536, "ab", DecodeInfo("lin-i8", 32, scales, None, Frames(2, (10, 20))))
    message = rpc_convert.piece_pb(piece)
    assert (message.name, message.offset, list(message.fragment.offsets), message.chunk_xxh3) == ("w", 84, [0, 0], "ab")
    assert (message.decode.codec, message.decode.block, message.decode.frame_rows, list(message.decode.frame_ends)) == ("lin-i8", 32, 2, [10, 20])
    assert message.decode.scales.name == "w.scales" and not message.decode.HasField("base")
    assert not rpc_convert.piece_pb(scales).HasField("decode")
    cache = rpc_convert.ShmPieces(keep=1)
    assert cache.get(piece) is cache.get(piece)


def test_slot_messages_are_built_once_per_plan_and_rank() -> None:
    plan = make_save_plan([specs(HALVES[0]), specs(HALVES[1])])
    slots = rpc_convert.SlotMessages()
    first = slots.get(plan, 1)
    assert first is slots.get(plan, 1) and [s.name for s in first] == [s.name for s in plan.slots_of(1)]


def test_a_status_snapshot_crosses_the_wire_and_narrows_to_a_job() -> None:
    in_flight = InFlightSave(job="a", step=1, state="writing", bytes_total=10, bytes_written=5, age_s=1.5, ranks_arrived=2, ranks_expected=2, write_s=0.5)
    snapshot = StatusSnapshot(
        version="1", root="/r", in_flight=(in_flight, replace(in_flight, job="b")), arena_bytes=1, arena_count=2,
        committed_total=3, failed_total=4, skipped_total=5, last_error="e", draining=True, queue_depth=6,
        last_commit=LastCommit("a", 1, 2.0, 3.0, 4, "/r/a/step-1"), node_rank=0, nodes=2, bytes_written_total=7,
        uptime_s=8.0, loads_active=9, link_mismatches_total=1,
    )
    message = rpc_convert.status_pb(snapshot.of_job("b", LastCommit("b", 7, 2.0, 3.0, 4, "/r/b/step-7"), "job b step 8: disk full"))
    assert [f.job for f in message.in_flight] == ["b"] and message.in_flight[0].bytes_written == 5
    assert (message.draining, message.nodes, message.loads_active, message.last_commit.step_dir) == (True, 2, 9, "/r/b/step-7")
    assert (message.last_error, message.committed_total) == ("job b step 8: disk full", 3)  # the job's own; daemon-wide counters stay
    assert not rpc_convert.status_pb(snapshot.of_job("c", None, "")).HasField("last_commit")  # job a's commit is not job c's
    assert message.link_mismatches_total == 1
    assert not rpc_convert.status_pb(replace(snapshot, last_commit=None)).HasField("last_commit")
    assert len(snapshot.in_flight) == 2


def test_committed_progress_and_staged_ranges() -> None:
    assert rpc_convert.committed_pb("/r/j/step-1") == pb.SaveProgress(state="committed", done=True, step_dir="/r/j/step-1")
    ranges = rpc_convert.staged_ranges([pb.StagedRange(staging_offset=1, arena_offset=2, nbytes=3)])
    assert [(r.staging_offset, r.arena_offset, r.nbytes) for r in ranges] == [(1, 2, 3)]


# issue 33 item 5: a restore from memory in the layout that saved it travels as columns
def _arena_piece(spec: TensorSpec, path: str, offset: int, **changed: object) -> PieceInfo:
    piece = PieceInfo(spec.name, "shm", path, offset, spec.nbytes, spec.box, spec.dtype, "")
    return piece._replace(**changed)  # type: ignore[arg-type]


WANTED = (
    TensorSpec("model/w", "model", "F32", (4, 2), Box.full((4, 2))),
    TensorSpec("model/b", "model", "BF16", (3,), Box.full((3,))),
    TensorSpec("optimizer/step", "optimizer", "I64", (), Box.full(())),
)


def test_memory_columns_lists_each_wanted_tensor_in_the_request_order_whatever_the_pieces_order() -> None:
    pieces = [_arena_piece(WANTED[2], "/shm/b", 0), _arena_piece(WANTED[0], "/shm/a", 64), _arena_piece(WANTED[1], "/shm/b", 8)]
    columns = rpc_convert.memory_columns(pieces, WANTED)
    assert columns is not None
    assert list(columns.paths) == ["/shm/a", "/shm/b"]
    assert (list(columns.file), list(columns.offset), list(columns.nbytes)) == ([0, 1, 1], [64, 8, 0], [32, 6, 8])


@pytest.mark.parametrize(
    "why, pieces",
    [
        ("a tensor missing (strict=False)", lambda: [_arena_piece(WANTED[0], "/a", 0), _arena_piece(WANTED[1], "/a", 32)]),
        ("a piece from a file", lambda: [_arena_piece(WANTED[0], "/a", 0, source="file"), *(_arena_piece(s, "/a", 64) for s in WANTED[1:])]),
        ("part of a fragment (resharded)", lambda: [_arena_piece(WANTED[0], "/a", 0, fragment=Box((0, 0), (2, 2)), nbytes=16), *(_arena_piece(s, "/a", 64) for s in WANTED[1:])]),
        ("another dtype", lambda: [_arena_piece(WANTED[0], "/a", 0), _arena_piece(WANTED[1], "/a", 32, dtype="F16"), _arena_piece(WANTED[2], "/a", 40)]),
        ("other bytes", lambda: [_arena_piece(WANTED[0], "/a", 0, nbytes=31), *(_arena_piece(s, "/a", 64) for s in WANTED[1:])]),
        ("codes to decode", lambda: [_arena_piece(WANTED[0], "/a", 0, decode=DecodeInfo("lin-i8", 32, None, None)), *(_arena_piece(s, "/a", 64) for s in WANTED[1:])]),
        ("two pieces of one tensor", lambda: [_arena_piece(WANTED[0], "/a", 0), _arena_piece(WANTED[0], "/a", 0), _arena_piece(WANTED[1], "/a", 32)]),
    ],
)
def test_memory_columns_are_none_unless_every_tensor_is_one_whole_arena_fragment(why: str, pieces: Callable[[], list[PieceInfo]]) -> None:
    assert rpc_convert.memory_columns(pieces(), WANTED) is None, why


def test_memory_columns_messages_are_built_once_per_plan_and_specs() -> None:
    pieces = tuple(_arena_piece(s, "/shm/a", 64 * i) for i, s in enumerate(WANTED))
    plan = LoadPlan("load-1", 5, pieces, {}, (), (), "memory", plan_id="p1")
    messages = rpc_convert.MemoryColumnsMessages(keep=2)
    first = messages.get(plan, WANTED)
    assert first is not None and messages.get(replace(plan, load_id="load-2"), WANTED) is first
    assert messages.get(plan, list(WANTED)) is not first  # other specs (another fingerprint): built for them
    assert rpc_convert.plan_load_response(plan, [], first).columns == first


def test_memory_columns_give_an_empty_tensor_without_a_piece_no_bytes_in_no_arena() -> None:
    empty = TensorSpec("model/empty", "model", "F32", (0, 3), Box.full((0, 3)))
    columns = rpc_convert.memory_columns([_arena_piece(WANTED[0], "/shm/a", 0)], (empty, WANTED[0]))
    assert columns is not None
    assert (list(columns.paths), list(columns.file), list(columns.offset), list(columns.nbytes)) == (["/shm/a"], [0, 0], [0, 0], [0, 32])
    assert rpc_convert.memory_columns([], (empty,)) == pb.MemoryColumns(file=[0], offset=[0], nbytes=[0])
