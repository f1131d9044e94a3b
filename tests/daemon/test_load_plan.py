"""The load planner (engine/load_plan.py): pure functions, tested with tables."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.plan.load_plan import (
    Location, StagedRead, TierName, extras_source, file_locations, file_sources, incomplete_message, load_tier, needs_decoding,
    plan_pieces, rank_extras,
)
from ckptd.daemon.errors import InvalidRequest
from ckptd.format.index import CheckpointIndex, FileRecord, FragmentRecord, QuantRecord, SideRecord, TensorRecord
from ckptd.daemon.plan.save_plan import TensorSpec

F1, F2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _index(tensors: tuple[TensorRecord, ...] = ()) -> CheckpointIndex:
    files = (FileRecord(F1, 100, "xxh3:1", node=0), FileRecord(F2, 100, "xxh3:2", node=1))
    return CheckpointIndex(job="job", step=7, created_at=0.0, world_size=2, tensors=tensors, files=files)


def _frag(file: str, offset: int, box: Box, quant: QuantRecord | None = None) -> FragmentRecord:
    return FragmentRecord(file=file, key=f"k{offset}", box=box, dtype="F32", offset=offset, nbytes=box.numel * 4, checksum="xxh3:0", quant=quant)


# model/w (4, 2): rows 0-1 in F1, rows 2-3 in F2; model/b (2,) whole in F1.
W = TensorRecord("model/w", "model", "F32", (4, 2), (_frag(F1, 0, Box((0, 0), (2, 2))), _frag(F2, 0, Box((2, 0), (2, 2)))))
B = TensorRecord("model/b", "model", "F32", (2,), (_frag(F1, 16, Box((0,), (2,))),))
OPT = TensorRecord("optim/m", "optimizer", "F32", (2,), (_frag(F1, 24, Box((0,), (2,))),))


def _want(name: str, shape: tuple[int, ...], box: Box | None = None) -> TensorSpec:
    return TensorSpec(name, name.split("/")[0], "F32", shape, box or Box.full(shape))


def _local(files: tuple[str, ...] = (F1, F2)) -> dict[str, Location]:
    return {f: Location(TierName.ROOT, 0, f"/root/job/step-00000007/{f}", False) for f in files}


def test_file_locations_by_node_and_access() -> None:
    files = _index().files
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
    f2 = _index().files[1]
    chosen, missing = file_sources([f2], 0, disk, memory)
    assert chosen.get(F2) == expected
    assert missing == ([] if expected else [f2])


def test_file_locations_of_replicas_are_always_staged() -> None:
    files = _index().files
    staging = "/dev/shm/fetch-{}".format
    where, tiers = {F1: 0, F2: 2}, {F1: M, F2: P}
    got = file_locations(files, 0, where, "/r/s/{}".format, staging, tiers)
    assert got == {F1: Location(M, 0, f"/dev/shm/fetch-{F1}", True), F2: Location(P, 2, f"/dev/shm/fetch-{F2}", True)}
    # the staged reads of a replica go to its holder
    planned = plan_pieces(_index((W,)), [_want("model/w", (4, 2))], ["model"], False, None, got)
    assert planned.reads == (StagedRead(F1, 0, 0, 16), StagedRead(F2, 2, 0, 16))


@pytest.mark.parametrize(
    ("wanted", "pieces"),
    [
        # the whole weight: both fragments, in fragment order
        ([_want("model/w", (4, 2))], [("model/w", F1, 0, Box((0, 0), (2, 2))), ("model/w", F2, 0, Box((2, 0), (2, 2)))]),
        # rows 1-2 (another layout): both fragments overlap; each piece is the stored fragment
        ([_want("model/w", (4, 2), Box((1, 0), (2, 2)))], [("model/w", F1, 0, Box((0, 0), (2, 2))), ("model/w", F2, 0, Box((2, 0), (2, 2)))]),
        # rows 2-3: only the second file
        ([_want("model/w", (4, 2), Box((2, 0), (2, 2)))], [("model/w", F2, 0, Box((2, 0), (2, 2)))]),
        ([_want("model/b", (2,))], [("model/b", F1, 16, Box((0,), (2,)))]),
    ],
)
def test_the_pieces_of_each_wanted_box_are_the_stored_fragments_that_overlap_it(wanted: list[TensorSpec], pieces: list[Any]) -> None:
    planned = plan_pieces(_index((B, W)), wanted, ["model"], False, None, _local())
    assert [(p.name, p.path.rsplit("/", 1)[1], p.offset, p.fragment) for p in planned.pieces] == pieces
    assert all(p.source == "file" for p in planned.pieces) and planned.reads == ()


@pytest.mark.parametrize(
    ("wanted", "kinds", "missing", "unexpected"),
    [
        ([_want("model/w", (4, 2)), _want("model/b", (2,))], ["model"], (), ()),
        ([_want("model/w", (4, 2))], ["model"], (), ("model/b",)),
        ([_want("model/w", (4, 2))], ["model", "optim"], (), ("model/b", "optim/m")),
        ([_want("model/w", (4, 2)), _want("model/new", (3,))], ["model"], ("model/new",), ("model/b",)),
        ([_want("model/w", (4, 2)), _want("model/b", (2,)), _want("rng/cuda", (8,))], ["model", "rng"], (), ()),  # rng/ is optional
    ],
)
def test_missing_and_unexpected_names(wanted: list[TensorSpec], kinds: list[str], missing: tuple[str, ...], unexpected: tuple[str, ...]) -> None:
    planned = plan_pieces(_index((B, W, OPT)), wanted, kinds, False, None, _local())
    assert (planned.missing, planned.unexpected) == (missing, unexpected)
    if missing or unexpected:
        with pytest.raises(InvalidRequest, match=r"pass strict=False to load the rest"):
            plan_pieces(_index((B, W, OPT)), wanted, kinds, True, None, _local())


def test_a_shape_that_differs_from_the_steps_is_refused_with_both_shapes() -> None:
    with pytest.raises(InvalidRequest, match=r"'model/w' has shape \[4, 2\] in step 7 but the state being loaded has \[4, 3\]"):
        plan_pieces(_index((W,)), [_want("model/w", (4, 3))], ["model"], False, None, _local())


def test_staged_files_give_one_read_per_range_however_many_tensors_share_it() -> None:
    locations = {
        F1: Location(TierName.ROOT, 0, "/dev/shm/s1", True),
        F2: Location(TierName.PEER_DISK, 1, "/dev/shm/s2", True),
    }
    wanted = [_want("model/w", (4, 2)), _want("model/b", (2,)), _want("model/w", (4, 2), Box((0, 0), (1, 2)))]
    planned = plan_pieces(_index((B, W)), wanted, ["model"], False, None, locations)
    assert [p.path for p in planned.pieces] == ["/dev/shm/s1", "/dev/shm/s2", "/dev/shm/s1", "/dev/shm/s1"]
    assert planned.reads == (StagedRead(F1, 0, 0, 16), StagedRead(F2, 1, 0, 16), StagedRead(F1, 0, 16, 8))


def test_a_quantized_fragment_loads_as_codes_with_its_scales_from_the_files() -> None:
    scales = SideRecord(file=F2, key="s", dtype="F32", shape=(2,), offset=40, nbytes=8, checksum="xxh3:9")
    coded = TensorRecord("optim/m", "optimizer", "F32", (2,), (_frag(F1, 24, Box((0,), (2,)), QuantRecord("lin-i8", 2, scales=scales)),))
    planned = plan_pieces(_index((coded,)), [_want("optim/m", (2,))], ["optim"], False, None, _local())
    (piece,) = planned.pieces
    assert piece.decode is not None and piece.decode.codec == "lin-i8" and piece.decode.block == 2
    assert piece.decode.scales is not None and piece.decode.scales.path.endswith(F2) and piece.decode.scales.offset == 40
    assert needs_decoding(_index((coded,)), [_want("optim/m", (2,))]) == (True, False)
    assert needs_decoding(_index((coded,)), [_want("model/w", (4, 2))]) == (False, False)


@pytest.mark.parametrize(
    ("sources", "held", "tier"),
    [(["shm", "shm"], False, "memory"), (["file"], False, "disk"), (["shm", "file"], True, "mixed"), ([], True, "memory"), ([], False, "disk")],
)
def test_the_loads_tier_label(sources: list[str], held: bool, tier: str) -> None:
    pieces = [type("P", (), {"source": s})() for s in sources]
    assert load_tier(pieces, object() if held else None) == tier  # type: ignore[arg-type]


def test_an_incomplete_step_names_its_files_tensors_writers_and_silent_nodes() -> None:
    index = _index((B, W))
    message = incomplete_message(index, [index.files[1]], {1: "connection refused"}, lambda n: f"node {n} (h{n}:7000)")
    assert message.startswith("step 7 of job 'job' is not complete on the nodes present: 1 files")
    assert f"({F2}) with tensors model/w were written by node 1 (h1:7000)" in message
    assert "node 1 (h1:7000) did not answer (connection refused)" in message
    assert message.endswith("start the missing nodes' daemons on their storage, or load an older step")


# ------------------------------------------------------------------ issue 30 finding 3: per-rank extras

# A step of 2 ranks: each rank's own "extra/t" (rank 0's in F1, rank 1's in F2), a tensor
# "extra/shared" of every rank (saved with a layout rule, or before extras were per rank).
OWN = tuple(
    TensorRecord(f"extra/rank{r}/t", "extra", "F32", (2,), (_frag(file, 32, Box((0,), (2,))),), rank=r) for r, file in ((0, F1), (1, F2))
)
SHARED = TensorRecord("extra/shared", "extra", "F32", (2,), (_frag(F1, 48, Box((0,), (2,))),))


def _own(name: str, rank: int) -> TensorSpec:
    """A per-rank request, as rank `rank`'s client sends it (its own name)."""
    key, _, rest = name.partition("/")
    return TensorSpec(f"{key}/rank{rank}/{rest}", "extra", "F32", (2,), Box.full((2,)), per_rank=True)


@pytest.mark.parametrize(
    ("rank", "file"),
    [
        (0, F1),  # its own copy
        (1, F2),
        (2, F1),  # a rank the step does not have (more ranks now): rank 0's, as its JSON extras
        (5, F1),
    ],
)
def test_issue30_finding3_a_ranks_own_extras_tensor_comes_from_its_extras_source(rank: int, file: str) -> None:
    planned = plan_pieces(_index((W, *OWN)), [_own("extra/t", rank)], ["extra"], True, None, _local(), rank)
    assert [(p.name, p.path.rsplit("/", 1)[1]) for p in planned.pieces] == [(f"extra/rank{rank}/t", file)]
    assert planned.unexpected == () and planned.missing == ()  # the other rank's copy is neither


def test_issue30_finding3_a_shared_extras_tensor_of_an_older_step_serves_every_rank() -> None:
    index = _index((W, SHARED))
    for rank in (0, 1, 3):
        planned = plan_pieces(index, [_own("extra/shared", rank)], ["extra"], True, None, _local(), rank)
        assert [p.name for p in planned.pieces] == [f"extra/rank{rank}/shared"] and planned.pieces[0].offset == 48


def test_issue30_finding3_a_plain_request_of_a_per_rank_tensor_takes_the_sources_copy() -> None:
    """Loaded with a layout rule (or as a DTensor) now: the copy of the rank whose extras it gets."""
    want = TensorSpec("extra/t", "extra", "F32", (2,), Box.full((2,)))
    planned = plan_pieces(_index((W, *OWN)), [want], ["extra"], True, None, _local(), 1)
    assert [(p.name, p.path.rsplit("/", 1)[1]) for p in planned.pieces] == [("extra/t", F2)]


def test_issue30_finding3_only_the_source_ranks_own_tensors_can_be_unexpected_or_missing() -> None:
    index = _index((W, *OWN))
    planned = plan_pieces(index, [], ["extra"], False, None, _local(), 1)
    assert planned.unexpected == ("extra/rank1/t",)
    planned = plan_pieces(index, [_own("extra/u", 1)], ["extra"], False, None, _local(), 1)
    assert planned.missing == ("extra/rank1/u",) and planned.unexpected == ("extra/rank1/t",)
    with pytest.raises(InvalidRequest, match=r"missing from step 7: extra/rank1/u; in step 7 but not in the state being loaded: extra/rank1/t"):
        plan_pieces(index, [_own("extra/u", 1)], ["extra"], True, None, _local(), 1)
    assert plan_pieces(index, [], ["extra"], False, None, _local(), 4).unexpected == ("extra/rank0/t",)  # rank 0's extras


def test_issue30_finding3_a_per_rank_request_must_carry_the_ranks_own_name() -> None:
    with pytest.raises(InvalidRequest, match=r"rank 1 asks for 'extra/rank0/t' as its own tensor.*rank1"):
        plan_pieces(_index((W, *OWN)), [_own("extra/t", 0)], ["extra"], True, None, _local(), 1)


def test_issue30_finding3_whose_extras_a_rank_loads() -> None:
    saved = {0: {"r": 0, "rng": {"python": 0}}, 1: {"r": 1, "rng": {"python": 1}}}
    assert [extras_source(r, 2) for r in range(4)] == [0, 1, 0, 0]
    assert rank_extras(saved, 1, 2) == saved[1]  # its own, RNG state included
    assert rank_extras(saved, 3, 2) == {"r": 0}  # rank 0's, without rank 0's generators
    assert rank_extras({}, 0, 1) == {}
