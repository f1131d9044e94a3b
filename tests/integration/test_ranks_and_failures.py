"""Several real rank processes, crashes of trainers and of the daemon, and bad requests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from ckptd.client import CheckpointClient
from ckptd.format.index import INDEX_NAME
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

RANKS = Path(__file__).with_name("ranks.py")


def run_ranks(mode: str, address: str, job: str, world: int, step: int, tmp: Path, ranks: range | None = None) -> list[subprocess.Popen]:
    procs = []
    for rank in ranks if ranks is not None else range(world):
        args = [sys.executable, str(RANKS), mode, address, job, str(rank), str(world), str(step)]
        if mode == "save":
            args.append(str(tmp / f"rank{rank}.json"))
        procs.append(subprocess.Popen(args))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 120) -> list[int]:
    return [p.wait(timeout) for p in procs]


def test_four_local_replicas_write_each_tensor_once(daemon, tmp_path: Path) -> None:
    assert wait_all(run_ranks("save", daemon.address, "ddp", 4, 10, tmp_path)) == [0, 0, 0, 0]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    step_dir = Path(reports[0]["step_dir"])
    index = json.loads((step_dir / INDEX_NAME).read_text())
    model_bytes = sum(t.numel() * 4 for t in torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)]).state_dict().values())
    copied = [r["bytes_copied"] for r in reports]
    assert sum(copied) == model_bytes  # each tensor handed over by exactly one rank
    assert max(copied) <= 1.5 * model_bytes / 4  # and the work spread over the ranks
    weights = load_file(step_dir / "model-00001-of-00001.safetensors")
    assert len(weights) == 24 and all(len(t["fragments"]) == 1 for t in index["tensors"].values())
    assert sum(t.numel() * 4 for t in weights.values()) == model_bytes
    extras = json.loads((step_dir / "extra.json").read_text())
    assert extras["ranks"] == {str(r): {"extra": {"rank": r}} for r in range(4)}  # every rank's own extras


def test_trainer_killed_mid_handoff_leaves_no_checkpoint_and_no_leak(daemons, tmp_path: Path) -> None:
    # rank 0 learns that step 2 failed when it times out: 10 s, enough for the other saves' two
    # rank processes to arrive on a loaded machine
    daemon = daemons.start("--save-timeout", "10")
    assert wait_all(run_ranks("save", daemon.address, "crash", 2, 1, tmp_path)) == [0, 0]

    # rank 0 hands its part over normally; rank 1 dies with its arena half written.
    ok = run_ranks("save", daemon.address, "crash", 2, 2, tmp_path, ranks=range(0, 1))
    dead = run_ranks("die-mid-save", daemon.address, "crash", 2, 2, tmp_path, ranks=range(1, 2))
    assert wait_all(dead) == [-9]
    with CheckpointClient("crash", address=daemon.address, rank=1, world_size=2, on_error="raise") as restarted:
        # the restarted rank 1 asks for the newest checkpoint: step 2 is abandoned, step 1 is served
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
        assert restarted.load({"model": model}) == 1
    assert wait_all(ok) == [1]  # rank 0's wait_durable learns that step 2 failed
    assert not (daemon.root / "crash" / "step-00000002").exists()
    assert (daemon.root / "crash" / "latest").read_text().strip() == "step-00000001"
    arenas = daemons.arenas()
    assert len(arenas) <= 2 * 2  # bounded: max_inflight sets of one arena per rank

    # the job goes on: the next saves by both ranks commit, in the same (reused) arenas
    for step in (3, 4):
        assert wait_all(run_ranks("save", daemon.address, "crash", 2, step, tmp_path)) == [0, 0]
        assert daemons.arenas() == arenas


def test_daemon_killed_mid_write_keeps_the_previous_checkpoint(daemons, tmp_path: Path) -> None:
    daemon = daemons.start("--write-throttle", "2000000")  # 2 MB/s: the write takes seconds
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # ~2 MiB
    with CheckpointClient("killed", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(2, 2)}).wait_durable(timeout=60)
        ckpt.save(2, {"model": model})
        deadline = time.monotonic() + 30
        while not any(f.state == "writing" and f.bytes_written > 0 for f in ckpt.status().in_flight):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    daemon.kill()
    step2 = daemon.root / "killed" / "step-00000002"
    assert step2.exists() and not (step2 / INDEX_NAME).exists()  # half written, not committed

    daemon_fast = daemons.start()
    assert not step2.exists()  # cleaned up at start
    with CheckpointClient("killed", address=daemon_fast.address, on_error="raise") as ckpt:
        restored = torch.nn.Linear(2, 2)
        assert ckpt.load({"model": restored}) == 1
        assert [i.step for i in ckpt.list()] == [1]
    assert (daemon.root / "killed" / "latest").read_text().strip() == "step-00000001"


def _stub(daemon) -> pb_grpc.CheckpointStub:
    return pb_grpc.CheckpointStub(grpc.insecure_channel(daemon.address))


def _meta(name="model/w", dtype="F32", shape=(4,), offsets=(0,), lengths=(4,), kind="model") -> pb.TensorMeta:
    return pb.TensorMeta(name=name, kind=kind, dtype=dtype, shape=shape, box=pb.Box(offsets=offsets, lengths=lengths))


WHO = pb.RankId(job="bad", rank=0, world_size=1)


@pytest.mark.parametrize(
    "method, request_, code, message",
    [
        ("BeginSave", pb.BeginSaveRequest(who=pb.RankId(job="../etc", rank=0, world_size=1), step=1, fingerprint="f", tensors=[_meta()]), "INVALID_ARGUMENT", "invalid job id"),
        ("BeginSave", pb.BeginSaveRequest(who=pb.RankId(job="bad", rank=3, world_size=2), step=1, fingerprint="f", tensors=[_meta()]), "INVALID_ARGUMENT", "rank 3"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=-1, fingerprint="f", tensors=[_meta()]), "INVALID_ARGUMENT", "step -1"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta(dtype="F33")]), "INVALID_ARGUMENT", "dtype 'F33'"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta(shape=(-4,))]), "INVALID_ARGUMENT", "shape"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta(shape=(1 << 40, 1 << 20))]), "INVALID_ARGUMENT", "larger than"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta(offsets=(2,), lengths=(4,))]), "INVALID_ARGUMENT", "does not lie inside"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta(name="")]), "INVALID_ARGUMENT", "non-empty"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta(kind="weights")]), "INVALID_ARGUMENT", "kind"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta(offsets=(0,), lengths=(2,))]), "INVALID_ARGUMENT", "do not tile"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="never-sent"), "FAILED_PRECONDITION", "unknown fingerprint"),
        ("BeginSave", pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", quantize="O9", tensors=[_meta()]), "INVALID_ARGUMENT", "quantize"),
        ("CommitSnapshot", pb.CommitSnapshotRequest(who=WHO, save_id="nope"), "NOT_FOUND", "no save"),
        ("PlanLoad", pb.PlanLoadRequest(who=WHO, latest=True, tensors=[_meta()]), "NOT_FOUND", "no committed checkpoint"),
        ("PlanLoad", pb.PlanLoadRequest(who=WHO, step=7, tensors=[_meta()]), "NOT_FOUND", "not committed"),
        ("PlanLoad", pb.PlanLoadRequest(who=WHO, latest=True, kinds=["a/b"]), "INVALID_ARGUMENT", "without '/'"),
        ("WaitDurable", pb.WaitDurableRequest(job="bad", step=99), "NOT_FOUND", "no save of step 99"),
        ("List", pb.ListRequest(job="a/../../b"), "INVALID_ARGUMENT", "invalid job id"),
    ],
)
def test_bad_requests_get_the_right_status_and_the_daemon_stays_up(daemon, method, request_, code, message) -> None:
    stub = _stub(daemon)
    call = getattr(stub, method)
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(request_, timeout=20)
        if method == "WaitDurable":
            list(reply)
    assert caught.value.code().name == code, caught.value.details()
    assert message in caught.value.details()
    assert stub.Status(pb.StatusRequest(), timeout=5).root  # still serving
    assert not any(p.name.startswith("..") for p in daemon.root.parent.iterdir())
    assert not (daemon.root.parent / "etc").exists()  # "../etc" as a job id wrote nothing outside the root


def test_bad_extras_are_refused(daemon) -> None:
    stub = _stub(daemon)
    begin = stub.BeginSave(pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta()], timeout_s=10), timeout=20)
    with pytest.raises(grpc.RpcError) as caught:
        stub.CommitSnapshot(pb.CommitSnapshotRequest(who=WHO, save_id=begin.save_id, extras_json="{not json"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid JSON" in caught.value.details()


def _save_as_ranks(address: str, job: str, world: int, step: int, state: dict) -> list:
    """`world` ranks as threads of this process, each with its own client (the save is collective)."""
    from concurrent.futures import ThreadPoolExecutor

    clients = [CheckpointClient(job, address=address, rank=r, world_size=world, on_error="raise") for r in range(world)]
    with ThreadPoolExecutor(world) as pool:
        handles = list(pool.map(lambda c: c.save(step, state), clients))
    return handles


def test_elastic_restart_with_another_world_size_keeps_the_save_being_written(daemons) -> None:
    daemon = daemons.start("--write-throttle", "4MiB")
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # ~2 MiB: written in ~0.5 s
    handles = _save_as_ranks(daemon.address, "elastic", 2, 1, {"model": model})
    with CheckpointClient("elastic", address=daemon.address, rank=0, world_size=1, on_error="raise") as single:
        restored = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        assert single.load({"model": restored}) == 1  # waits for the step every rank handed over
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))
        single.save(2, {"model": model}).wait_durable(timeout=60)
        assert handles[0].wait_durable(timeout=60).step == 1
        assert [i.step for i in single.list()] == [1, 2]
