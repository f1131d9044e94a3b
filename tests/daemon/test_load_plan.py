"""The daemon's load planner (plan/load_plan.py): where each file is read, the held snapshot's
pieces, labels and messages; pure functions, tested with tables. Its file part is
ckptd.format.file_plan (tests/format/test_file_plan.py)."""

from __future__ import annotations

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.errors import InvalidRequest
from ckptd.daemon.plan.load_plan import Location, TierName, broadcast_routes, file_locations, file_sources, incomplete_message, load_tier, needs_decoding, plan_pieces
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.format.file_plan import SHM_SOURCE, PieceInfo, StagedRead
from ckptd.format.index import FileRecord, QuantRecord, SideRecord, TensorRecord
from index_rig import B, F1, F2, W, fragment, index_of  # tests/index_rig.py


def _want(name: str, shape: tuple[int, ...], box: Box | None = None) -> TensorSpec:
    return TensorSpec(name, name.split("/")[0], "F32", shape, box or Box.full(shape))


def _local(files: tuple[str, ...] = (F1, F2)) -> dict[str, Location]:
    return {f: Location(TierName.ROOT, 0, f"/root/job/step-00000007/{f}", False) for f in files}


def test_file_locations_by_node_and_access() -> None:
    files = index_of().files
    staging = "/dev/shm/fetch-{}".format
    local = "/r/s/{}".format
    assert file_locations(files, 0, {}, local, staging) == {
        F1: Location(TierName.ROOT, 0, f"/r/s/{F1}", False),
        F2: Location(TierName.ROOT, 0, f"/r/s/{F2}", False),
    }
    assert file_locations(files, 0, {F2: 1}, local, staging)[F2] == Location(TierName.PEER_DISK, 1, f"/dev/shm/fetch-{F2}", True)
    no_access = file_locations(files, 0, {}, lambda f: None, staging)  # a rank that cannot read the root, or no local files
    assert no_access[F1] == Location(TierName.ROOT, 0, f"/dev/shm/fetch-{F1}", True)


M, P, L, D = TierName.REPLICA_HERE, TierName.REPLICA_PEER, TierName.ROOT, TierName.PEER_DISK


@pytest.mark.parametrize(
    ("disk", "memory", "expected"),
    [
        # every tier holds F2 (written by node 1, 100 bytes): memory here wins, then a peer's memory, then disk here, then a peer's disk
        ({0: {F2: 100}, 1: {F2: 100}}, {0: {F2: 100}, 2: {F2: 100}}, (M, 0)),
        ({0: {F2: 100}, 1: {F2: 100}}, {2: {F2: 100}, 3: {F2: 100}}, (P, 2)),  # the lowest peer among equals
        ({0: {F2: 100}, 1: {F2: 100}}, {}, (L, 0)),
        ({1: {F2: 100}, 2: {F2: 100}}, {}, (D, 1)),
        # a holder counts only with the index's size (a part being written, another step's file)
        ({0: {F2: 99}, 2: {F2: 100}}, {1: {F2: 7}}, (D, 2)),
        ({0: {}, 1: {}}, {1: {F2: 99}}, None),
    ],
)
def test_file_sources_by_tier(disk: dict, memory: dict, expected: tuple | None) -> None:
    f2 = index_of().files[1]
    chosen, missing = file_sources([f2], 0, disk, memory)
    assert chosen.get(F2) == expected
    assert missing == ([] if expected else [f2])


def test_file_locations_of_replicas_are_always_staged() -> None:
    files = index_of().files
    staging = "/dev/shm/fetch-{}".format
    where, tiers = {F1: 0, F2: 2}, {F1: M, F2: P}
    got = file_locations(files, 0, where, "/r/s/{}".format, staging, tiers)
    assert got == {F1: Location(M, 0, f"/dev/shm/fetch-{F1}", True), F2: Location(P, 2, f"/dev/shm/fetch-{F2}", True)}
    # the staged reads of a replica go to its holder
    planned = plan_pieces(index_of((W,)), [_want("model/w", (4, 2))], ["model"], False, None, got)
    assert planned.reads == (StagedRead(F1, 0, 0, 16), StagedRead(F2, 2, 0, 16))


@pytest.mark.parametrize(
    ("sources", "held", "tier"),
    [(["shm", "shm"], False, "memory"), (["file"], False, "disk"), (["shm", "file"], True, "mixed"), ([], True, "memory"), ([], False, "disk")],
)
def test_the_loads_tier_label(sources: list[str], held: bool, tier: str) -> None:
    pieces = [type("P", (), {"source": s})() for s in sources]
    assert load_tier(pieces, object() if held else None) == tier  # type: ignore[arg-type]


def test_an_incomplete_step_names_its_files_tensors_writers_and_silent_nodes() -> None:
    index = index_of((B, W))
    message = incomplete_message(index, [index.files[1]], {1: "connection refused"}, lambda n: f"node {n} (h{n}:7000)")
    assert message.startswith("step 7 of job 'job' is not complete on the nodes present: 1 files")
    assert f"({F2}) with tensors model/w were written by node 1 (h1:7000)" in message
    assert "node 1 (h1:7000) did not answer (connection refused)" in message
    assert message.endswith("start the missing nodes' daemons on their storage, or load an older step")


def test_which_pieces_need_decoding() -> None:
    scales = SideRecord(file=F2, key="s", dtype="F32", shape=(2,), offset=40, nbytes=8, checksum="xxh3:9")
    coded = TensorRecord("optim/m", "optimizer", "F32", (2,), (fragment(F1, 24, Box((0,), (2,)), QuantRecord("lin-i8", 2, scales=scales)),))
    assert needs_decoding(index_of((coded,)), [_want("optim/m", (2,))]) == (True, False)
    assert needs_decoding(index_of((coded,)), [_want("model/w", (4, 2))]) == (False, False)


class _Held:
    """A HeldSnapshot holding model/w whole on this node."""

    key, layout, extras = 1, object(), None

    def current(self, step: int) -> bool:
        return True

    def pieces(self, spec: TensorSpec, record: TensorRecord) -> list[PieceInfo] | None:
        if spec.name != "model/w":
            return None
        return [PieceInfo(spec.name, SHM_SOURCE, "/dev/shm/arena-0", 64, 32, Box((0, 0), (4, 2)), "F32", "")]


def test_the_held_snapshot_serves_what_it_holds_and_the_files_the_rest() -> None:
    planned = plan_pieces(index_of((B, W)), [_want("model/w", (4, 2)), _want("model/b", (2,))], ["model"], True, _Held(), _local())
    assert [(p.name, p.source, p.path.rsplit("/", 1)[1]) for p in planned.pieces] == [("model/w", "shm", "arena-0"), ("model/b", "file", F1)]


@pytest.mark.parametrize(
    ("wanted", "words"),
    [
        ([_want("model/w", (4, 3))], r"'model/w' has shape \[4, 2\] in step 7 but the state being loaded has \[4, 3\]"),
        ([_want("model/w", (4, 2))], r"in step 7 but not in the state being loaded: model/b \(pass strict=False"),
    ],
)
def test_a_state_that_does_not_match_the_step_is_an_invalid_request(wanted: list[TensorSpec], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        plan_pieces(index_of((B, W)), wanted, ["model"], True, _Held(), _local())


def _files(*writers: int) -> list[FileRecord]:
    return [FileRecord(f"f{i}.safetensors", 100, f"xxh3:{i}", node=w) for i, w in enumerate(writers)]


@pytest.mark.parametrize(
    "writers, node, nodes, where, needed, avoid, fetch, read_once",
    [
        # a shared root, data-parallel replicas: other writers' files fetched, this node's read once
        ((0, 1, 2, 3), 1, 4, {}, {"f0.safetensors", "f1.safetensors", "f2.safetensors", "f3.safetensors"}, (),
         {"f0.safetensors": 0, "f2.safetensors": 2, "f3.safetensors": 3}, {"f1.safetensors"}),
        # each node reads only its own files (tensor or pipeline parallel): nothing changes
        ((0, 1, 2, 3), 1, 4, {}, {"f1.safetensors"}, (), {}, set()),
        # a writer that failed lately, or that is not a node of this job (saved by more nodes): read here
        ((0, 1, 7), 0, 4, {}, {"f1.safetensors", "f2.safetensors"}, (1,), {}, set()),
        ((0, 1, 7), 0, 4, {}, {"f0.safetensors", "f1.safetensors", "f2.safetensors"}, (1,), {}, set()),
        ((0, 1), 0, 4, {}, {"f0.safetensors", "f1.safetensors"}, (1,), {}, set()),
        # node-local roots: another node's file already comes from it; this node's own is read once for all
        ((0, 1), 0, 2, {"f1.safetensors": 1}, {"f0.safetensors", "f1.safetensors"}, (), {}, {"f0.safetensors"}),
        # a file not needed is never routed
        ((0, 1, 2), 0, 3, {}, {"f1.safetensors"}, (), {"f1.safetensors": 1}, set()),
    ],
)
def test_broadcast_routes(writers, node, nodes, where, needed, avoid, fetch, read_once) -> None:
    routes = broadcast_routes(_files(*writers), node, nodes, where, needed, avoid)
    assert dict(routes.fetch) == fetch and set(routes.read_once) == read_once


def test_decoding_needs_are_worked_out_once_per_index_and_wanted_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.daemon.engine import loads

    calls: list[int] = []
    monkeypatch.setattr(loads, "needs_decoding", lambda index, wanted: calls.append(len(wanted)) or (False, False))
    needs = loads.DecodingNeeds(size=2)
    scales = SideRecord(file=F2, key="s", dtype="F32", shape=(2,), offset=40, nbytes=8, checksum="xxh3:9")
    index = index_of((TensorRecord("optim/m", "optimizer", "F32", (2,), (fragment(F1, 24, Box((0,), (2,)), QuantRecord("lin-i8", 2, scales=scales)),)),))
    wanted = [_want("optim/m", (2,))]
    assert needs.of(index, wanted) == needs.of(index, wanted) == (False, False)
    assert calls == [1]  # the same objects: asked once
    needs.of(index, list(wanted))  # other specs (equal, not the same object): asked again
    needs.of(index_of(()), wanted)
    needs.of(index, wanted)  # forgotten: only the last two are kept
    assert calls == [1, 1, 1, 1]


def test_decoding_needs_do_not_keep_an_index_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import weakref

    from ckptd.daemon.engine import loads

    monkeypatch.setattr(loads, "needs_decoding", lambda index, wanted: (False, False))
    needs = loads.DecodingNeeds()
    index, wanted = index_of(()), [_want("optim/m", (2,))]
    needs.of(index, wanted)
    gone = weakref.ref(index)
    del index
    gc.collect()
    assert gone() is None  # the engine's index cache bounds how many parsed indexes live, not this
