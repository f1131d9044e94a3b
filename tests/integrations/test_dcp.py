"""torch.distributed.checkpoint through ckptd: dcp.save -> ckptd -> dcp.load in another world
size, and back (a ckptd step exported as a DCP directory that DCP loads in another world size)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_file

from ckptd.client import CheckpointClient
from ckptd.demo.process import DaemonProcess
from ckptd.integrations.dcp import CkptdStorageReader, CkptdStorageWriter, ckptd_name, dcp_fqn, export_dcp
from ckptd.offline import open_step

SCRIPT = Path(__file__).with_name("dcp_rank.py")
sys.path.insert(0, str(SCRIPT.parent))
sys.path.insert(0, str(SCRIPT.parents[1]))
from dcp_rank import reference  # noqa: E402
from worker_process import run_ranks  # noqa: E402
from daemon_rig import free_port  # noqa: E402


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


def _launch(world: int, **spec: object) -> None:
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPT), json.dumps({**spec, "rank": r, "world_size": world, "port": port})], stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    failed = [(r, e) for r, (p, e) in enumerate(zip(procs, errors)) if p.returncode != 0]
    assert not failed, "\n".join(f"rank {r}: ...{e[-3000:]}" for r, e in failed)


def _check(out: Path, world: int, step_count: int) -> None:
    expected = {f"model.{n}": t for n, t in reference().items()}
    for rank in range(world):
        got = load_file(f"{out}-{rank}.safetensors")
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name
        assert got["step_count"].tolist() == [step_count]


@pytest.mark.slow
def test_dcp_save_by_two_ranks_loads_in_three_and_exports_back(daemon, tmp_path: Path) -> None:
    _launch(2, mode="save", address=daemon.address, job="dcp", step=40)
    step_dir = daemon.root / "dcp" / "step-00000040"
    assert (step_dir / "ckptd.index.json").is_file()
    weights = open_step(step_dir).state_dict("model")  # the model files hold the bare FQNs
    assert set(weights) == {"embed.weight", "proj.weight", "proj.bias"}

    _launch(3, mode="load", step_dir=str(step_dir), out=str(tmp_path / "three"))
    _check(tmp_path / "three", 3, 40)

    exported = tmp_path / "exported"
    keys = export_dcp(step_dir, exported)
    assert "model.embed.weight" in keys and (exported / ".metadata").is_file()
    _launch(3, mode="load", dcp_dir=str(exported), out=str(tmp_path / "back"))
    for rank in range(3):
        got = load_file(f"{tmp_path / 'back'}-{rank}.safetensors")
        for name, tensor in reference().items():
            assert torch.equal(got[f"model.{name}"], tensor)


def test_a_native_ckptd_step_loads_with_dcp_under_dcp_names(daemon) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with CheckpointClient("native", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(5, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
    state = {"model": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, "optimizer": {"state": {"weight": {"exp_avg": torch.zeros(3, 4)}}}}
    dcp.load(state, storage_reader=CkptdStorageReader(info.step_dir))
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert torch.equal(state["optimizer"]["state"]["weight"]["exp_avg"], opt.state[model.weight]["exp_avg"])


# a new user's probe, 2026-12-01: get_state_dict's optimizer dict asked for param_groups the reader did not serve
def test_a_native_ckptd_step_loads_into_get_state_dicts_dicts(daemon) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with CheckpointClient("native-gsd", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(5, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh(torch.randn(2, 4)).sum().backward()
    fresh_opt.step()
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, storage_reader=CkptdStorageReader(info.step_dir))
    group = state["optimizer"]["param_groups"][0]
    assert (group["lr"], tuple(group["betas"]), group["params"]) == (0.01, (0.8, 0.9), ["weight", "bias"])
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert torch.equal(state["optimizer"]["state"]["weight"]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_async_save_in_one_process_hands_off_and_commits(daemon) -> None:
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "meta": {"lr": 0.1}}
    writer = CkptdStorageWriter("async", address=daemon.address)
    try:
        dcp.async_save(state, storage_writer=writer, checkpoint_id=7).result(timeout=60)
        info = writer.handle.wait_durable(timeout=60)
    finally:
        writer.close()
    loaded = {"model": {"w": torch.zeros(3, 4)}, "meta": {"lr": 0.0}}
    dcp.load(loaded, storage_reader=CkptdStorageReader(info.step_dir))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["meta"] == {"lr": 0.1}


@pytest.mark.parametrize(
    ("fqn", "key", "path"),
    [("model.layers.0.weight", "model", "layers.0.weight"), ("optimizer.state.w.exp_avg", "optimizer", "state.w.exp_avg"), ("step", "dcp", "step"), ("lr.x", "dcp", "lr.x")],
)
def test_names_round_trip(fqn: str, key: str, path: str) -> None:
    assert ckptd_name(fqn) == (key, path)
    assert dcp_fqn(f"{key}/{path}") == fqn


def test_a_writer_needs_a_step(daemon) -> None:
    writer = CkptdStorageWriter("nostep", address=daemon.address)
    with pytest.raises(ValueError, match="no step to save"):
        writer.set_up_storage_writer(True)
    with pytest.raises(CheckpointException, match="no step to save"):  # DCP wraps the writer's error
        dcp.save({"model": {"w": torch.ones(2)}}, storage_writer=writer)
    with pytest.raises(ValueError, match="step number"):
        writer.reset("not-a-step")
    assert not CkptdStorageWriter.validate_checkpoint_id("/some/dir") and CkptdStorageWriter.validate_checkpoint_id("12")
    writer.close()


# a new user's probe, 2026-12-01: dcp.save took a datetime, then dcp.load refused the whole step
def test_a_value_a_load_could_not_read_back_is_refused_at_save(daemon) -> None:
    import datetime

    writer = CkptdStorageWriter("dcp-datetime", address=daemon.address)
    writer.reset(1)
    with pytest.raises(CheckpointException, match=r"cannot checkpoint DCP entry 'when' with ckptd: .*store it as plain values"):
        dcp.save({"model": {"w": torch.ones(2)}, "when": datetime.datetime(2026, 12, 1)}, storage_writer=writer)
    writer.reset(2)
    dcp.save({"model": {"w": torch.ones(2)}, "when": "2026-12-01"}, storage_writer=writer)  # plain values: saved
    assert writer.handle is not None and writer.handle.wait_durable(timeout=60).step == 2
    writer.close()


def test_export_refuses_a_non_empty_target(daemon, tmp_path: Path) -> None:
    with CheckpointClient("exp", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(1, {"model": torch.nn.Linear(2, 2)}).wait_durable(timeout=60)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        export_dcp(info.step_dir, tmp_path / "out")


def test_ckptd_export_format_dcp_writes_a_directory_dcp_loads(daemon, tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    with CheckpointClient("cli-exp", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(2, {"model": model}).wait_durable(timeout=60)
    out = tmp_path / "dcp-out"
    done = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "export", info.step_dir, str(out), "--format", "dcp"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    state = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(out)))
    assert torch.equal(state["model"]["weight"], model.weight.detach())


def test_a_crafted_bytes_entry_is_refused_before_dcp_unpickles_it(daemon, tmp_path: Path) -> None:
    """A step altered to hold a pickle that runs code: the reader refuses it, nothing runs."""
    import base64
    import pickle  # noqa: F401 - only to build the attacker's payload in the test

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = base64.b64encode(pickle.dumps(Evil())).decode()
    with CheckpointClient("evil", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(1, {"model": {"w": torch.ones(2)}, "dcp_bytes": {"note": payload}}).wait_durable(timeout=60)
    state = {"model": {"w": torch.zeros(2)}, "note": 0}
    with pytest.raises(CheckpointException) as refused:
        dcp.load(state, storage_reader=CkptdStorageReader(info.step_dir))
    assert "DCP entry 'note' is not a value torch.load(weights_only=True) accepts" in str(refused.value)
    assert not marker.exists()


def test_a_writer_per_save_in_one_process_is_one_run(daemon) -> None:
    """Review of issue 30: a new CkptdStorageWriter per dcp.save (DCP never closes it) made each
    save its own "run", and step 2 was refused while step 1's writer stayed attached."""
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}}
    writers = [CkptdStorageWriter("per-save", address=daemon.address) for _ in range(2)]
    for step, writer in enumerate(writers, start=1):
        dcp.save(state, storage_writer=writer, checkpoint_id=step)
        assert writer.handle.wait_durable(timeout=60) is not None, step
    with CheckpointClient("per-save", address=daemon.address) as ckpt:
        assert [c.step for c in ckpt.list()] == [1, 2]
    for writer in writers:
        writer.close()


# issue 31 item 7: several local chunks of one tensor per rank
def test_several_chunks_of_a_tensor_per_rank_save_and_load_in_another_world_size(daemon) -> None:
    script = SCRIPT.with_name("dcp_chunks_rank.py")
    run_ranks(script, 2, mode="save", address=daemon.address, job="chunks", step=3)
    step_dir = daemon.root / "chunks" / "step-00000003"
    # the four chunks (two of each rank) cover the tensor: the daemon stores it whole
    whole = open_step(step_dir).tensors_named(["model/embed.weight"])["model/embed.weight"]
    assert torch.equal(whole, torch.arange(60.0).reshape(12, 5) * len("xembed.weight"))
    run_ranks(script, 3, mode="load", step_dir=str(step_dir))


# issue 31 item 7: DCP's plans kept across saves; dcp.async_save stages through the writer
def test_async_saves_through_the_writer_reuse_the_plan_until_the_structure_changes(daemon) -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(3)}, "meta": {"lr": 0.1}, "step_count": torch.tensor([7])}
    writer = CkptdStorageWriter("plans", address=daemon.address)
    assert isinstance(writer, AsyncStager)  # dcp.async_save makes no copy of its own first
    try:
        for step in (1, 2, 3):
            state["model"]["w"].add_(1.0)
            dcp.async_save(state, storage_writer=writer, checkpoint_id=step, planner=writer.planner).result(timeout=60)
            info = writer.handle.wait_durable(timeout=60)
        assert writer.planner.local_plans_built == 1  # values changed, the structure did not
        state["model"]["extra"] = torch.ones(2)  # a new tensor: planned again, and saved
        dcp.save(state, storage_writer=writer, checkpoint_id=4, planner=writer.planner)
        assert writer.planner.local_plans_built == 2
        last = writer.handle.wait_durable(timeout=60)
        # a save that fails in DCP's thread before the hand-off ends async_save, with the error, instead of hanging it
        failing = CkptdStorageWriter("plans-fail", address=daemon.address)
        with pytest.raises(CheckpointException, match="no step to save"):
            dcp.async_save(state, storage_writer=failing).result(timeout=60)
        failing.close()
    finally:
        writer.close()
    loaded = {"model": {"w": torch.zeros(3, 4), "b": torch.ones(3)}, "meta": {"lr": 0.0}, "step_count": torch.zeros(1, dtype=torch.int64)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(info.step_dir))
    assert torch.equal(loaded["model"]["w"], torch.arange(12.0).reshape(3, 4) + 3) and loaded["meta"] == {"lr": 0.1}
    assert loaded["step_count"].tolist() == [7]  # a tensor outside model/optimizer: one for the job, not per rank
    assert open_step(last.step_dir).tensors_named(["model/extra"])["model/extra"].tolist() == [1.0, 1.0]


# issue 31 item 7: the writer's per-plan layout and the client's copy plan follow a changed structure
def test_a_tensor_resized_or_recast_between_saves_is_saved_as_it_is_now(daemon) -> None:
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(3)}}
    writer = CkptdStorageWriter("restructured", address=daemon.address)
    try:
        for step, change in enumerate([None, ("w", torch.arange(20.0).reshape(4, 5)), ("b", torch.arange(3, dtype=torch.float64)), None], start=1):
            if change is not None:
                state["model"][change[0]] = change[1]
            state["model"]["w"].add_(1.0)  # the values of every save differ
            dcp.save(state, storage_writer=writer, checkpoint_id=step, planner=writer.planner)
            info = writer.handle.wait_durable(timeout=60)
            stored = open_step(info.step_dir).tensors_named(["model/w", "model/b"])
            for name, tensor in state["model"].items():
                got = stored[f"model/{name}"]
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), (step, name)
        assert writer.planner.local_plans_built == 3  # the last save kept the third plan
    finally:
        writer.close()
