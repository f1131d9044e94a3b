"""The coordinator's per-node bookkeeping and the commit's layout record, as tables: the same
answers as before they were made linear in nodes (issue 23, tests/bench/bench_scale.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.engine.coordinator import Coordinator
from ckptd.daemon.engine.requests import JoinSave, ReportManifest
from ckptd.daemon.errors import InvalidRequest
from ckptd.format.index import CheckpointIndex, FileRecord, FragmentRecord
from ckptd.daemon.plan.files import NodeManifest, environment_json
from ckptd.daemon.plan.save_plan import TensorSpec, make_save_plan
from ckptd.daemon.rpc.peer_links import PeerLinks
from ckptd.daemon.storage import Storage


@pytest.mark.parametrize(
    "node_of_rank, ranks_per_node",
    [
        ((), [1]),  # no nodes given: every rank on node 0
        ((0,), [1]),
        ((0, 0, 1, 1), [2, 2]),
        ((0, 0, 0, 1), [3, 1]),
        ((1, 0, 1, 2, 2, 2), [1, 2, 3]),  # ranks of a node need not be consecutive; listed in node order
        ((3, 3, 5), [2, 1]),  # node numbers with gaps: only the nodes that have ranks
        (tuple(r // 8 for r in range(8 * 50)), [8] * 50),
    ],
)
def test_environment_json_counts_the_ranks_of_each_node_in_node_order(node_of_rank: tuple[int, ...], ranks_per_node: list[int]) -> None:
    world = len(node_of_rank) or 1
    specs = [[TensorSpec("model/w", "model", "F32", (world,), Box((r,), (1,)))] for r in range(world)]
    plan = make_save_plan(specs, node_of_rank or None)
    layout = json.loads(environment_json(plan, None, "host"))["layout"]
    assert layout["ranks_per_node"] == ranks_per_node
    assert layout["nodes"] == len(ranks_per_node)
    assert layout["world_size"] == world


SHAPE = (6, 2)


def third(node: int) -> Box:
    return Box((2 * node, 0), (2, 2))


def manifest(node: int) -> NodeManifest:
    name = f"model-{node + 1:05d}-of-00003.safetensors"
    fragment = FragmentRecord(name, f"w@{2 * node},0", third(node), "F32", 84, 16, "xxh3-64:1")
    return NodeManifest(node, (FileRecord(name, 100, "xxh3-64:0", node),), (("model/w", fragment),))


async def no_retention(index: CheckpointIndex) -> None:
    return None


class Answering(PeerLinks):
    """Every node says it is still writing (no network in these tests)."""

    async def saving(self, node: int, job: str, step: int, timeout_s: float = 2.0) -> bool | None:
        return True


@pytest.mark.parametrize(
    "joined, reports, commits_after",
    [
        # nodes that joined, (node, reports a manifest) in order, index of the report that commits (None: none does)
        ((0, 1, 2), [0, 1, 2], 2),
        ((0, 1, 2), [2, 0, 1], 2),
        ((0, 1, 2), [1, 2], None),  # node 0 never reports: no commit
        ((0, 1, 2), [0, 0, 1], None),  # a node reporting twice does not count twice
    ],
)
def test_the_commit_waits_for_every_node_that_joined(tmp_path: Path, joined: tuple[int, ...], reports: list[int], commits_after: int | None) -> None:
    async def scenario() -> None:
        storage = Storage(tmp_path)
        coord = Coordinator(storage, Answering([f"n{n}" for n in range(3)], ""), "own-root", no_retention)  # node-local roots
        results = await asyncio.gather(
            *[coord.join(JoinSave("job", 1, 3, {n: f"fp{n}"}, {n: (TensorSpec("model/w", "model", "F32", SHAPE, third(n)),)}, [], 30.0, None), n, f"root{n}") for n in joined]
        )
        save_id = results[0].save_id
        tasks = []
        for i, node in enumerate(reports):
            tasks.append(asyncio.create_task(coord.report(ReportManifest("job", 1, save_id, manifest(node)), node)))
            if i == commits_after:  # the commit writes files: wait for it rather than for a fixed time
                await asyncio.wait_for(asyncio.shield(tasks[-1]), 60)
            else:
                await asyncio.sleep(0.01)
            assert coord.deciding("job", 1) == (commits_after is None or i < commits_after), (i, node)
        if commits_after is not None:
            outcomes = await asyncio.gather(*tasks)
            assert all(o.committed for o in outcomes)
        else:
            for task in tasks:
                task.cancel()

    asyncio.run(scenario())


def test_a_report_from_a_node_that_did_not_join_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        coord = Coordinator(Storage(tmp_path), Answering(["a", "b", "c"], ""), "own-root", no_retention)
        specs = {n: (TensorSpec("model/w", "model", "F32", (2,), Box((n,), (1,))),) for n in (0, 1)}
        results = await asyncio.gather(*[coord.join(JoinSave("job", 1, 2, {n: f"fp{n}"}, {n: specs[n]}, [], 30.0, None), n, f"root{n}") for n in (0, 1)])
        with pytest.raises(InvalidRequest, match="node 2 did not join the save of step 1"):
            await coord.report(ReportManifest("job", 1, results[0].save_id, manifest(2)), 2)

    asyncio.run(scenario())
