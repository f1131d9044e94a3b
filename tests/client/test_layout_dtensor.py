"""Real DTensors on real processes (gloo, CPU): their fragments tile the global tensor with its values.

The test runs this file as a program (`python test_layout_dtensor.py OUT_DIR`), which imports
torch once and forks jobs of 2 and 4 ranks that rendezvous through files. Each rank distributes known
global tensors with many placements, builds real FSDP2 / HSDP / FSDP2-over-TP models with Adam
state, computes `fragments_of`, and writes every fragment (box and values) as JSON; the parent
checks that, per tensor, the distinct boxes cover the global tensor exactly and every fragment
(replicas included) holds the global tensor's values there. The ranks also check
`verify_replicated`, and compare boxes with torch's compute_local_shape_and_global_offset.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ckptd.client.layout import Fragment, LayoutError, fragments_of, layout_state, verify_replicated
from ckptd.client.state import flatten_state
from ckptd.common.boxes import Box, coverage_problems

HERE = Path(__file__).resolve()

# name: (global shape, mesh shape, placements)
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], list[Placement]]] = {
    "fsdp_rows": ((8, 3), (4,), [Shard(0)]),
    "uneven_7_over_4": ((7, 3), (4,), [Shard(0)]),
    "2_rows_over_4": ((2, 5), (4,), [Shard(0)]),
    "cols": ((3, 6), (4,), [Shard(1)]),
    "uneven_cols": ((2, 5), (4,), [Shard(1)]),
    "replicate": ((3, 4), (4,), [Replicate()]),
    "hsdp": ((7, 2), (2, 2), [Replicate(), Shard(0)]),
    "both_dims": ((5, 7), (2, 2), [Shard(0), Shard(1)]),
    "same_dim_twice": ((7, 3), (2, 2), [Shard(0), Shard(0)]),
    "strided": ((6, 2), (2, 2), [_StridedShard(0, split_factor=3), Shard(0)]),
    "vector": ((9,), (4,), [Shard(0)]),
    "scalar": ((), (4,), [Replicate()]),
    "w2_rows": ((5, 3), (2,), [Shard(0)]),
    "w2_cols": ((3, 5), (2,), [Shard(1)]),
    "w2_replicate": ((4,), (2,), [Replicate()]),
}
MODELS = {4: ("fsdp2", "hsdp", "fsdp2_tp"), 2: ("fsdp2",)}
WORLDS = (2, 4)


def known(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)


# ------------------------------------------------------------------ the ranks


def rank_main(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    """One rank: write what fragments_of says about many DTensors to OUT_DIR/rank<RANK>.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    report: dict[str, Any] = {"tensors": {}, "errors": {}}

    def record(name: str, fragments: list[Fragment], full: torch.Tensor, placements: str) -> None:
        described = [
            {"offsets": list(f.box.offsets), "lengths": list(f.box.lengths), "global_shape": list(f.global_shape),
             "values": f.local.reshape(-1).tolist()}
            for f in fragments
        ]
        report["tensors"][name] = {
            "global_shape": list(full.shape), "full": full.reshape(-1).tolist(), "placements": placements, "fragments": described,
        }

    meshes: dict[tuple[int, ...], Any] = {}
    for name, (shape, mesh_shape, placements) in CASES.items():
        if math.prod(mesh_shape) != world:
            continue
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        mesh = meshes[mesh_shape]
        full = known(shape)
        dtensor = distribute_tensor(full, mesh, placements)
        fragments = fragments_of(name, dtensor, None, None)
        memory = dtensor.to_local().untyped_storage().data_ptr()
        assert all(f.local.untyped_storage().data_ptr() == memory for f in fragments if f.local.numel()), "not views"
        if not any(isinstance(p, _StridedShard) for p in placements):
            torch_shape, torch_offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
            assert [(f.box.lengths, f.box.offsets) for f in fragments] == [(tuple(torch_shape), tuple(torch_offset))], name
        record(name, fragments, full, str(placements))

    try:
        fragments_of("partial", DTensor.from_local(torch.ones(4), meshes[(world,)], [Partial()]), None, None)
    except LayoutError as exc:
        report["errors"]["partial"] = str(exc)

    for model_name in MODELS[world]:
        torch.manual_seed(0)  # the same model on every rank
        hidden = 6 if model_name == "fsdp2_tp" else 7  # TP: 3 rows per TP rank, split unevenly by FSDP
        model = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 2), nn.LayerNorm(2))
        if model_name == "fsdp2":
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        elif model_name == "hsdp":
            fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        else:  # FSDP2 over TP: the TP-sharded dim is sharded again by FSDP (strided placements)
            mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh2d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh2d["dp"])
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        for lay in layout_state(flatten_state({"model": model, "optimizer": opt}, rank=rank)):
            tensor = lay.entry.tensor
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            placements = str(list(tensor.placements)) if hasattr(tensor, "placements") else "plain"
            record(f"{model_name}:{lay.entry.name}", list(lay.fragments), full.detach(), placements)

    group = dist.new_group(list(range(world)))
    verify_replicated({"a": torch.ones(3), "b": torch.arange(4)}, group)
    try:
        verify_replicated({"a": torch.ones(3), "b": torch.arange(4) * (rank % 2)}, group)
    except LayoutError as exc:
        report["errors"]["drift"] = str(exc)
    try:
        verify_replicated({"a": torch.ones(3)} if rank else {"b": torch.ones(3)}, group)
    except LayoutError as exc:
        report["errors"]["names"] = str(exc)

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


# ------------------------------------------------------------------ the test


def launch(out_dir: Path, timeout: float) -> int:
    """Run every rank of every job as a forked child of this process, which imported torch once
    (starting 6 interpreters that each import torch takes several times longer on a small machine).
    Returns 0 when all ranks succeeded; as soon as one fails, the others (which would wait for it in
    a collective) are stopped."""
    fork = multiprocessing.get_context("fork")
    procs = []
    for world in WORLDS:
        (out_dir / f"world{world}").mkdir()
        for rank in range(world):
            args = (rank, world, str(out_dir / f"rdzv{world}"), str(out_dir / f"world{world}"))
            procs.append(fork.Process(target=rank_main, args=args, name=f"world{world}-rank{rank}"))
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        failed = [p.name for p in procs if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            running = [p.name for p in procs if p.is_alive()]
            print(f"failed: {failed}" if failed else f"timed out; still running: {running}", flush=True)
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


@pytest.fixture(scope="module")
def reports() -> Iterator[dict[int, list[dict[str, Any]]]]:
    with tempfile.TemporaryDirectory(prefix="ckptd-layout-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, str(HERE), tmp], env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"a rank failed:\n{done.stdout}\n{done.stderr}"
        yield {w: [json.loads((Path(tmp) / f"world{w}" / f"rank{r}.json").read_text()) for r in range(w)] for w in WORLDS}


def check_tiling(name: str, per_rank: list[dict[str, Any]]) -> None:
    entries = [r["tensors"][name] for r in per_rank]
    shape = tuple(entries[0]["global_shape"])
    full = torch.tensor(entries[0]["full"], dtype=torch.float64).reshape(shape)
    boxes = set()
    for rank, entry in enumerate(entries):
        assert torch.equal(torch.tensor(entry["full"], dtype=torch.float64).reshape(shape), full)
        for f in entry["fragments"]:
            box = Box(tuple(f["offsets"]), tuple(f["lengths"]))
            assert tuple(f["global_shape"]) == shape
            assert box.fits_in(shape), f"{name}: rank {rank}'s box {box} is outside {shape}"
            want = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
            got = torch.tensor(f["values"], dtype=torch.float64).reshape(box.lengths)
            assert torch.equal(got, want), f"{name}: rank {rank}'s fragment {box} holds the wrong values"
            boxes.add(box)
    assert coverage_problems(shape, boxes) == [], f"{name} ({entries[0]['placements']})"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_fragments_tile_the_global_tensor_with_its_values(reports, world: int) -> None:
    per_rank = reports[world]
    names = sorted(per_rank[0]["tensors"])
    expected_cases = {n for n, (_, mesh, _) in CASES.items() if math.prod(mesh) == world}
    assert expected_cases <= set(names)
    for model_name in MODELS[world]:
        assert any(n.startswith(f"{model_name}:optimizer/state/") for n in names), model_name
    for name in names:
        check_tiling(name, per_rank)


@pytest.mark.slow
def test_fsdp2_over_tp_uses_strided_shards_and_still_tiles(reports) -> None:
    placements = {n: t["placements"] for n, t in reports[4][0]["tensors"].items() if n.startswith("fsdp2_tp:")}
    assert any("_StridedShard" in p for p in placements.values()), placements


@pytest.mark.slow
def test_partial_dtensors_and_drifting_replicas_are_refused(reports) -> None:
    for _world, per_rank in reports.items():
        for report in per_rank:
            assert "reduce it before saving" in report["errors"]["partial"]
            assert "'b' (ranks [1" in report["errors"]["drift"] and "'a'" not in report["errors"]["drift"]
            assert "different sets of replicated tensors" in report["errors"]["names"]


if __name__ == "__main__":
    sys.exit(launch(Path(sys.argv[1]), timeout=120))
