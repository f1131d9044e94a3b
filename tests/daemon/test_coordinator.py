"""The coordinator's barrier, commit and abort, in process (no gRPC between nodes), on real files."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from memory_backend import MemoryStorage

from ckptd.common.boxes import Box
from ckptd.daemon.engine.coordinator import Coordinator, root_sharing
from ckptd.daemon.engine.plan_inputs import check_plan_input, plan_key
from ckptd.daemon.engine.requests import JoinSave, ReportManifest
from ckptd.daemon.errors import Aborted, InvalidRequest, Precondition
from ckptd.format.index import CheckpointIndex, FileRecord, FragmentRecord
from ckptd.daemon.plan.compression import Compression, SaveOptions, decide_compression
from ckptd.daemon.plan.files import NodeManifest
from ckptd.daemon.plan.save_plan import PlanError, TensorSpec, make_save_plan, spec_digest
from ckptd.daemon.records import JoinResult
from ckptd.daemon.rpc.convert import manifest_from_wire, manifest_to_wire
from ckptd.daemon.rpc.peer_links import PeerLinks
from ckptd.daemon.storage import Storage, StorageBackend

SHAPE = (4, 2)
HALVES = [Box((0, 0), (2, 2)), Box((2, 0), (2, 2))]


def spec(box: Box) -> tuple[TensorSpec, ...]:
    return (TensorSpec("model/w", "model", "F32", SHAPE, box),)


def manifest(node: int, box: Box) -> NodeManifest:
    name = f"model-{node + 1:05d}-of-00002.safetensors"
    return NodeManifest(node, (FileRecord(name, 100, "xxh3-64:0", node),), (("model/w", FragmentRecord(name, f"w@{box.offsets[0]},0", box, "F32", 84, 16, "xxh3-64:1")),))


async def no_retention(index: CheckpointIndex) -> None:
    return None


def coordinator(tmp_path: Path, storage: StorageBackend | None = None) -> Coordinator:
    tmp_path.mkdir(exist_ok=True)
    storage = storage if storage is not None else Storage(tmp_path)
    return Coordinator(storage, PeerLinks(["127.0.0.1:1", "127.0.0.1:2"], "t" * 16), storage.catalog.root_id(), no_retention)


@pytest.fixture(params=["posix", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> StorageBackend:
    """The coordinator's commit runs on both backends (tests/memory_backend.py: the test double)."""
    return Storage(tmp_path) if request.param == "posix" else MemoryStorage()


def written_part(storage: StorageBackend, step: int, name: str, data: bytes) -> None:
    """A node's data file of `step`, written and published as the writer does (not committed)."""
    storage.writing.prepare_step("job", step, fresh=False)
    part = storage.writing.open_part("job", step, name, len(data))
    part.pwrite(0, memoryview(data))
    part.sync()
    part.close()
    part.publish()
    storage.writing.sync_step("job", step)


async def join_both(coord: Coordinator, step: int = 1) -> list:
    return await asyncio.gather(
        *[coord.join(JoinSave("job", step, 2, {n: f"fp{n}"}, {n: spec(HALVES[n])}, [], 30.0, None), n, coord.root_id) for n in (0, 1)]
    )


def test_root_ids_are_shared_by_a_root_and_differ_between_roots(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = Storage(tmp_path / "a"), Storage(tmp_path / "b")
    assert a.catalog.root_id() == Storage(tmp_path / "a").catalog.root_id() != b.catalog.root_id()


def test_plan_key_depends_on_fingerprints_and_nodes() -> None:
    assert plan_key(("a", "b"), (0, 1)) != plan_key(("a", "b"), (0, 0))
    assert plan_key(("a", "b"), (0, 1)) != plan_key(("a", "c"), (0, 1))
    assert plan_key(("a", "b"), (0, 1)) == plan_key(["a", "b"], [0, 1])


def test_every_node_gets_the_same_plan_input_and_the_commit_writes_the_index(tmp_path: Path, storage: StorageBackend) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path, storage)
        results = await join_both(coord)
        assert results[0] == results[1] and results[0].node_of_rank == (0, 1) and results[0].shared_root
        save_id = results[0].save_id
        outcomes = await asyncio.gather(
            *[coord.report(ReportManifest("job", 1, save_id, manifest(n, HALVES[n]), "", {n: {"r": n}}), n) for n in (0, 1)]
        )
        assert all(o.committed for o in outcomes)
        # the next save of the same layout does not resend the metadata
        again = await asyncio.gather(
            *[coord.join(JoinSave("job", 2, 2, {n: f"fp{n}"}, {}, [results[0].plan_key], 30.0, None), n, coord.root_id) for n in (0, 1)]
        )
        assert again[0].specs is None
        # a decided save kept for late reports holds nothing per rank (issue 34) and still answers them
        late = await coord.report(ReportManifest("job", 1, save_id, manifest(1, HALVES[1])), 1)
        assert late.committed
        kept = coord._saves[("job", 1)]
        assert not (kept.fingerprints or kept.rank_specs or kept.node_of_rank or kept.rank_nodes or kept.all_specs)

    for n in (0, 1):
        written_part(storage, 1, f"model-{n + 1:05d}-of-00002.safetensors", b"x" * 100)
    asyncio.run(scenario())
    assert storage.catalog.is_committed("job", 1) and storage.catalog.latest_step("job") == 1
    assert storage.files.read_index("job", 1).step == 1


def test_a_node_that_fails_aborts_the_step_for_every_node(tmp_path: Path, storage: StorageBackend) -> None:
    async def scenario() -> list:
        coord = coordinator(tmp_path, storage)
        save_id = (await join_both(coord))[0].save_id
        return await asyncio.gather(
            coord.report(ReportManifest("job", 1, save_id, manifest(0, HALVES[0])), 0),
            coord.report(ReportManifest("job", 1, save_id, None, "disk full"), 1),
        )

    written_part(storage, 1, "model-00001-of-00002.safetensors", b"x" * 100)
    outcomes = asyncio.run(scenario())
    assert [o.committed for o in outcomes] == [False, False]
    assert "node 1 failed: disk full" in outcomes[0].error
    assert not storage.catalog.is_committed("job", 1) and storage.files.step_file_sizes("job", 1) == {}


def test_manifests_that_miss_a_fragment_do_not_commit(tmp_path: Path, storage: StorageBackend) -> None:
    async def scenario() -> list:
        coord = coordinator(tmp_path, storage)
        save_id = (await join_both(coord))[0].save_id
        return await asyncio.gather(*[coord.report(ReportManifest("job", 1, save_id, manifest(n, HALVES[0])), n) for n in (0, 1)])

    outcomes = asyncio.run(scenario())
    assert not outcomes[0].committed and "not written exactly once" in outcomes[0].error
    assert not storage.catalog.is_committed("job", 1)


@pytest.mark.parametrize(
    ("second", "error", "message"),
    [
        ({"fingerprints": {0: "fp0"}}, InvalidRequest, "served by node 0 and by node 1"),
        ({"world_size": 3}, InvalidRequest, "other nodes say 2"),
        ({"fingerprints": {1: "unknown"}, "specs": {}}, Precondition, "unknown fingerprint"),
    ],
)
def test_bad_joins_are_refused_with_what_to_fix(tmp_path: Path, second: dict, error: type, message: str) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        first = asyncio.ensure_future(coord.join(JoinSave("job", 1, 2, {0: "fp0"}, {0: spec(HALVES[0])}, [], 2.0, None), 0, coord.root_id))
        await asyncio.sleep(0)
        kwargs = {"fingerprints": {1: "fp1"}, "specs": {1: spec(HALVES[1])}, "world_size": 2, **second}
        with pytest.raises(error, match=message):
            await coord.join(JoinSave("job", 1, kwargs["world_size"], kwargs["fingerprints"], kwargs["specs"], [], 2.0, None), 1, coord.root_id)
        with pytest.raises(Aborted, match="never joined"):
            await first

    asyncio.run(scenario())


def test_a_manifest_crosses_the_wire_unchanged_chunk_checksums_included() -> None:
    sent = NodeManifest(
        1,
        (FileRecord("model-00002-of-00002.safetensors", 100, "xxh3-64:0", 1),),
        (("model/w", FragmentRecord("model-00002-of-00002.safetensors", "w@2,0", HALVES[1], "F32", 84, 16, "xxh3-64:1", 65536, "0123456789abcdef")),),
    )
    assert manifest_from_wire(1, *manifest_to_wire(sent)) == sent


def test_the_coordinator_decides_the_compression_once_for_every_node(tmp_path: Path) -> None:
    """Issue 21 item 4: node 0 decides each save's compression when it plans it, from the ranks'
    options and the deepest lineage of any node, with its own settings; every node gets the
    same decision. Nodes that ask for different options are refused."""
    decided: list[tuple[SaveOptions, int]] = []

    def decide(options: SaveOptions, lineage: int) -> Compression:
        decided.append((options, lineage))
        return decide_compression(options, lineage, "O1", "keep", 3)

    async def scenario() -> list:
        storage = Storage(tmp_path)
        coord = Coordinator(storage, PeerLinks(["127.0.0.1:1", "127.0.0.1:2"], "t" * 16), storage.catalog.root_id(), no_retention, decide)
        return await asyncio.gather(
            *[coord.join(JoinSave("job", 1, 2, {n: f"fp{n}"}, {n: spec(HALVES[n])}, [], 30.0, None, SaveOptions(), n), n, coord.root_id) for n in (0, 1)]
        )

    results = asyncio.run(scenario())
    assert decided == [(SaveOptions(), 1)]  # once, with the deepest lineage (node 1's)
    assert results[0].compression == results[1].compression == Compression("O1", "keep", 2, True)


def test_nodes_whose_ranks_ask_for_different_compression_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        first = asyncio.ensure_future(coord.join(JoinSave("job", 1, 2, {0: "fp0"}, {0: spec(HALVES[0])}, [], 1.0, None, SaveOptions("O1")), 0, coord.root_id))
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequest, match="node 1's ranks ask for quantize=None.*other nodes' ranks asked for quantize='O1'"):
            await coord.join(JoinSave("job", 1, 2, {1: "fp1"}, {1: spec(HALVES[1])}, [], 1.0, None, SaveOptions()), 1, coord.root_id)
        with pytest.raises(Aborted, match="never joined"):
            await first

    asyncio.run(scenario())


# ------------------------------------------------------------------ issue 30 finding 1
# The coordinator's cache is each job's own, keyed by the daemon's digests of the metadata
# (plan.spec_digest): no job is planned from what another job sent, other metadata under a known
# digest is planned from (not the cached plan), and an aborted save's plan is not kept.

HUGE = (1 << 46,)  # 2^46 elements: 256 TiB of F32, refused only when its arena is reserved


def whole(dtype: str = "BF16", shape: tuple[int, ...] = SHAPE) -> tuple[TensorSpec, ...]:
    return (TensorSpec("model/w", "model", dtype, shape, Box.full(shape)),)


async def join_alone(coord: Coordinator, job: str, step: int, digest: str, specs: tuple[TensorSpec, ...] | None) -> JoinResult:
    """The join of a one-rank job on node 0 (planned at once); specs None: the digest alone."""
    return await coord.join(JoinSave(job, step, 1, {0: digest}, {} if specs is None else {0: specs}, [], 30.0, None), 0, coord.root_id)


@pytest.mark.parametrize("evil", [whole("F16"), whole("F32", HUGE)], ids=["same-size-other-dtype", "2^46-elements"])
def test_a_job_is_never_planned_from_another_jobs_metadata_under_the_same_digest(tmp_path: Path, evil: tuple[TensorSpec, ...]) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        await join_alone(coord, "evil", 1, "d", evil)
        victim = await join_alone(coord, "victim", 1, "d", whole())
        assert victim.plan is not None and victim.plan.tensors == make_save_plan([whole()]).tensors
        assert victim.plan.arena_bytes == make_save_plan([whole()]).arena_bytes
        with pytest.raises(Precondition, match="unknown fingerprint"):  # a job that never sent metadata under "d" is asked for it
            await join_alone(coord, "third", 1, "d", None)

    asyncio.run(scenario())


def test_other_metadata_under_a_known_digest_is_planned_from_not_the_cached_plan(tmp_path: Path) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        first = await join_alone(coord, "job", 1, "d", whole("BF16"))
        changed = await join_alone(coord, "job", 2, "d", whole("F16"))
        assert first.plan is not None and first.plan.tensors[0].dtype == "BF16"
        assert changed.plan is not None and changed.plan.tensors[0].dtype == "F16"
        named = await join_alone(coord, "job", 3, "d", None)  # the digest alone: the metadata sent last
        assert named.plan is changed.plan  # cached: equal input, the same plan

    asyncio.run(scenario())


def test_an_aborted_saves_plan_is_not_kept(tmp_path: Path) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        refused = await join_alone(coord, "job", 1, "d", whole("F32", HUGE))
        outcome = await coord.report(ReportManifest("job", 1, refused.save_id, None, "cannot reserve 256 TiB of shared memory"), 0)
        assert not outcome.committed
        again = await join_alone(coord, "job", 2, "d", None)
        assert again.plan is not None and again.plan is not refused.plan  # planned anew
        assert (await join_alone(coord, "job", 3, "d", None)).plan is again.plan  # a save under way keeps its plan

    asyncio.run(scenario())


def test_a_jobs_cache_starts_anew_when_its_world_size_changes(tmp_path: Path) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        await join_alone(coord, "job", 1, "d", whole())
        with pytest.raises(Precondition, match="unknown fingerprint"):
            await coord.join(JoinSave("job", 2, 2, {0: "d"}, {}, [], 1.0, None), 0, coord.root_id)

    asyncio.run(scenario())


def _answer(specs: tuple[tuple[TensorSpec, ...], ...], nodes: tuple[int, ...]) -> JoinResult:
    digests = tuple(spec_digest(s) for s in specs)
    return JoinResult("s", plan_key(digests, nodes), nodes, specs, True, fingerprints=digests)


def test_a_member_checks_the_coordinators_plan_input_against_its_digests() -> None:
    """A member node caches the plan it makes from node 0's answer under the answer's key: the
    key and the digests must be those of the metadata (plan_input.check_plan_input)."""
    good = _answer((spec(HALVES[0]), spec(HALVES[1])), (0, 1))
    check_plan_input(good, "node 0")
    check_plan_input(replace(good, specs=None, fingerprints=()), "node 0")  # a known plan: nothing to check
    other_dtype = (replace(spec(HALVES[0])[0], dtype="F16"),)
    with pytest.raises(Aborted, match="metadata of rank 0 that does not match its digest"):
        check_plan_input(replace(good, specs=(other_dtype, spec(HALVES[1]))), "node 0")
    with pytest.raises(Aborted, match="not the key of the ranks' digests"):
        check_plan_input(replace(good, plan_key="k"), "node 0")
    with pytest.raises(Aborted, match="without their digests"):
        check_plan_input(replace(good, fingerprints=()), "node 0")


def test_replicas_metadata_is_held_once_and_planned_once(tmp_path: Path) -> None:
    """Data-parallel replicas on different nodes send equal metadata under one digest, each as
    its own parsed object: the coordinator keeps one object per digest (memory O(distinct
    layouts + ranks), issue 34) and plans from it (the planner describes it once)."""
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        halves = [spec(HALVES[0]), spec(HALVES[1])]
        digests = [spec_digest(h) for h in halves]
        joins = [
            coord.join(JoinSave("job", 1, 4, {2 * n: digests[0], 2 * n + 1: digests[1]}, {2 * n: spec(HALVES[0]), 2 * n + 1: spec(HALVES[1])}, [], 30.0, None),
                       n, coord.root_id)
            for n in range(2)
        ]
        first, _ = await asyncio.gather(*joins)
        assert first.specs is not None and first.specs[0] is first.specs[2] and first.specs[1] is first.specs[3]
        assert first.plan == make_save_plan([halves[0], halves[1]] * 2, [0, 0, 1, 1])

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("root_ids", "shared"),
    [
        ({0: "a"}, False),  # one node
        ({1: "a"}, False),  # one node, not the coordinator, on the coordinator's root
        ({0: "a", 1: "a", 2: "a"}, True),
        ({0: "a", 1: "b", 2: "c"}, False),  # each its own
        ({1: "b", 2: "c"}, False),
    ],
)
def test_root_sharing_is_all_or_none(root_ids: dict[int, str], shared: bool) -> None:
    assert root_sharing(root_ids, "a") is shared


@pytest.mark.parametrize(
    ("root_ids", "said"),
    [
        ({0: "a", 1: "a", 2: "c"}, "nodes 0 and 1 write into one storage root (id a) but node 2 writes into another"),
        ({0: "a", 1: "b", 2: "b"}, "nodes 1 and 2 write into one storage root (id b) but node 0 writes into another"),
        ({1: "b", 2: "b"}, "but the coordinator (node 0) writes into another"),
        ({0: "a", 1: "c", 2: "b", 3: "b", 4: "d", 5: "e"}, "nodes 2 and 3 write into one storage root (id b) but nodes 0, 1, 4 and more write into another"),
    ],
)
def test_a_root_shared_by_some_nodes_only_is_refused(root_ids: dict[int, str], said: str) -> None:
    """A node that believes its root is its own empties the step directory before writing: with
    the root half shared, nodes would delete each other's files."""
    with pytest.raises(PlanError, match="every node of a job must write into one shared root, or each into a root of its own") as caught:
        root_sharing(root_ids, "a")
    assert said in str(caught.value)


def test_a_save_on_a_half_shared_root_is_refused_for_every_node(tmp_path: Path) -> None:
    """Nodes 1 and 2 share a root that the coordinator does not: every node's join is refused
    with the fix, and nothing is written."""
    async def scenario() -> list:
        storage = Storage(tmp_path / "0")
        coord = Coordinator(storage, PeerLinks(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], "t" * 16), storage.catalog.root_id(), no_retention)
        thirds = [Box((0, 0), (1, 2)), Box((1, 0), (1, 2)), Box((2, 0), (2, 2))]
        roots = {0: coord.root_id, 1: "shared-root-id", 2: "shared-root-id"}
        return await asyncio.gather(
            *[coord.join(JoinSave("job", 1, 3, {n: f"fp{n}"}, {n: spec(thirds[n])}, [], 30.0, None), n, roots[n]) for n in (0, 1, 2)],
            return_exceptions=True,
        )

    (tmp_path / "0").mkdir()
    results = asyncio.run(scenario())
    assert all(isinstance(r, InvalidRequest) and "nodes 1 and 2 write into one storage root" in str(r) for r in results), results
