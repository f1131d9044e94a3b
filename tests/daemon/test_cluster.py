"""The coordinator's barrier, commit and abort, in process (no gRPC between nodes), on real files."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.cluster import Coordinator, PeerLinks, manifest_from_wire, manifest_to_wire, merged_quantization, plan_key, root_id
from ckptd.daemon.errors import Aborted, InvalidRequest, Precondition
from ckptd.daemon.format import FileRecord, FragmentRecord
from ckptd.daemon.pipeline import NodeManifest
from ckptd.daemon.plan import TensorSpec
from ckptd.daemon.storage import Storage

SHAPE = (4, 2)
HALVES = [Box((0, 0), (2, 2)), Box((2, 0), (2, 2))]


def spec(box: Box) -> tuple[TensorSpec, ...]:
    return (TensorSpec("model/w", "model", "F32", SHAPE, box),)


def manifest(node: int, box: Box) -> NodeManifest:
    name = f"model-{node + 1:05d}-of-00002.safetensors"
    return NodeManifest(node, (FileRecord(name, 100, "xxh3-64:0", node),), (("model/w", FragmentRecord(name, f"w@{box.offsets[0]},0", box, "F32", 84, 16, "xxh3-64:1")),))


async def no_retention(job: str) -> None:
    return None


def coordinator(tmp_path: Path) -> Coordinator:
    storage = Storage(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    return Coordinator(storage, PeerLinks(["127.0.0.1:1", "127.0.0.1:2"], "t" * 16), root_id(tmp_path), no_retention)


async def join_both(coord: Coordinator, step: int = 1) -> list:
    return await asyncio.gather(
        *[coord.join("job", step, n, 2, {n: f"fp{n}"}, {n: spec(HALVES[n])}, [], coord.root_id, 30.0, None) for n in (0, 1)]
    )


def test_root_ids_are_shared_by_a_root_and_differ_between_roots(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert root_id(tmp_path / "a") == root_id(tmp_path / "a") != root_id(tmp_path / "b")


def test_plan_key_depends_on_fingerprints_and_nodes() -> None:
    assert plan_key({0: "a", 1: "b"}, {0: 0, 1: 1}) != plan_key({0: "a", 1: "b"}, {0: 0, 1: 0})
    assert plan_key({0: "a", 1: "b"}, {0: 0, 1: 1}) != plan_key({0: "a", 1: "c"}, {0: 0, 1: 1})


def test_every_node_gets_the_same_plan_input_and_the_commit_writes_the_index(tmp_path: Path) -> None:
    async def scenario() -> None:
        coord = coordinator(tmp_path)
        results = await join_both(coord)
        assert results[0] == results[1] and results[0].node_of_rank == (0, 1) and results[0].shared_root
        save_id = results[0].save_id
        outcomes = await asyncio.gather(
            *[coord.report("job", 1, save_id, n, manifest(n, HALVES[n]), "", {n: {"r": n}}, {}) for n in (0, 1)]
        )
        assert all(o.committed for o in outcomes)
        # the next save of the same layout does not resend the metadata
        again = await asyncio.gather(
            *[coord.join("job", 2, n, 2, {n: f"fp{n}"}, {}, [results[0].plan_key], coord.root_id, 30.0, None) for n in (0, 1)]
        )
        assert again[0].specs is None

    (tmp_path / "job" / "step-00000001").mkdir(parents=True)
    for n in (0, 1):
        (tmp_path / "job" / "step-00000001" / f"model-{n + 1:05d}-of-00002.safetensors").write_bytes(b"x" * 100)
    asyncio.run(scenario())
    assert Storage(tmp_path).is_committed("job", 1) and Storage(tmp_path).latest_step("job") == 1


def test_a_node_that_fails_aborts_the_step_for_every_node(tmp_path: Path) -> None:
    async def scenario() -> list:
        coord = coordinator(tmp_path)
        save_id = (await join_both(coord))[0].save_id
        return await asyncio.gather(
            coord.report("job", 1, save_id, 0, manifest(0, HALVES[0]), "", {}, {}),
            coord.report("job", 1, save_id, 1, None, "disk full", {}, {}),
        )

    outcomes = asyncio.run(scenario())
    assert [o.committed for o in outcomes] == [False, False]
    assert "node 1 failed: disk full" in outcomes[0].error
    assert not (tmp_path / "job" / "step-00000001").exists()


def test_manifests_that_miss_a_fragment_do_not_commit(tmp_path: Path) -> None:
    async def scenario() -> list:
        coord = coordinator(tmp_path)
        save_id = (await join_both(coord))[0].save_id
        return await asyncio.gather(*[coord.report("job", 1, save_id, n, manifest(n, HALVES[0]), "", {}, {}) for n in (0, 1)])

    outcomes = asyncio.run(scenario())
    assert not outcomes[0].committed and "not written exactly once" in outcomes[0].error
    assert not Storage(tmp_path).is_committed("job", 1)


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
        first = asyncio.ensure_future(coord.join("job", 1, 0, 2, {0: "fp0"}, {0: spec(HALVES[0])}, [], coord.root_id, 2.0, None))
        await asyncio.sleep(0)
        kwargs = {"fingerprints": {1: "fp1"}, "specs": {1: spec(HALVES[1])}, "world_size": 2, **second}
        with pytest.raises(error, match=message):
            await coord.join("job", 1, 1, kwargs["world_size"], kwargs["fingerprints"], kwargs["specs"], [], coord.root_id, 2.0, None)
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


O1 = {"generation": 1, "quantize": "O1", "master_weights": "keep"}
O2_DEEP = {"generation": 2, "quantize": "O2", "master_weights": "drop"}
LOSSLESS_AFTER_LOSSY = {"generation": 1, "quantize": None, "master_weights": "keep"}


@pytest.mark.parametrize(
    "records, expected",
    [
        ({0: None, 1: None}, None),
        ({0: O1, 1: O1}, O1),
        ({0: None, 1: O1}, O1),  # one node compressed: the step is lossy
        ({0: O1, 1: O2_DEEP}, O2_DEEP),  # the deepest lineage, whichever node has it
        ({0: LOSSLESS_AFTER_LOSSY, 1: O1}, LOSSLESS_AFTER_LOSSY),  # same generation: the lowest node
    ],
)
def test_merged_quantization_keeps_the_deepest_lineage(records: dict, expected: dict | None) -> None:
    assert merged_quantization(records) == expected


def test_merged_quantization_warns_when_nodes_disagree(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon.cluster"):
        merged_quantization({0: O1, 1: O1})
        assert not caplog.records
        merged_quantization({0: O1, 1: O2_DEEP})
    assert "different compression" in caplog.text and "node 1" in caplog.text
