"""Input ckptd cannot store is refused up front with INVALID_ARGUMENT (or a ValueError in the
client) naming what to change, and a damaged step names the file and what to do (issue 20,
finding 6): extras nested too deep, tensor names that would clash as safetensors keys, a shard
deleted under a load through shared memory."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from ckptd.client import CheckpointClient, tree
from ckptd.client.errors import CheckpointError
from ckptd.common.names import InvalidNameError, check_tensor_name
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

WHO = pb.RankId(job="bad", rank=0, world_size=1)
# The documented limits (ckptd.common.names.MAX_EXTRAS_DEPTH, MAX_EXTRAS_JSON_DEPTH), spelled out
# here as the contract the tests hold the code to.
MAX_EXTRAS_DEPTH = 64
MAX_EXTRAS_JSON_DEPTH = 256


def _stub(daemon) -> pb_grpc.CheckpointStub:
    return pb_grpc.CheckpointStub(grpc.insecure_channel(daemon.address))


def _meta(name: str = "model/w", kind: str = "model") -> pb.TensorMeta:
    return pb.TensorMeta(name=name, kind=kind, dtype="F32", shape=(4,), box=pb.Box(offsets=(0,), lengths=(4,)))


def _nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# --- (a) extras nested too deep ---------------------------------------------------------------


def test_the_client_refuses_extras_nested_past_the_limit_naming_the_path() -> None:
    tree.encode(_nested(MAX_EXTRAS_DEPTH), "extra", lambda name, t: None)  # at the limit: fine
    with pytest.raises(ValueError) as caught:
        tree.encode({"cfg": _nested(MAX_EXTRAS_DEPTH)}, "extra", lambda name, t: None)
    message = str(caught.value)
    assert "'extra/cfg" + "/0" * (MAX_EXTRAS_DEPTH - 1) + "'" in message and f"at most {MAX_EXTRAS_DEPTH} deep" in message
    with pytest.raises(ValueError, match=f"at most {MAX_EXTRAS_DEPTH} deep"):  # far past it: no RecursionError
        tree.encode(_nested(5000), "extra", lambda name, t: None)


@pytest.mark.parametrize("depth", [MAX_EXTRAS_JSON_DEPTH + 1, 100_000])
def test_the_daemon_refuses_extras_json_nested_past_the_limit(daemon, depth: int) -> None:
    """Parseable but too deep, and deeper than the JSON parser goes (was INTERNAL: RecursionError)."""
    stub = _stub(daemon)
    begin = stub.BeginSave(pb.BeginSaveRequest(who=WHO, step=1, fingerprint="f", tensors=[_meta()], timeout_s=10), timeout=20)
    deep = "[" * depth + "]" * depth
    with pytest.raises(grpc.RpcError) as caught:
        stub.CommitSnapshot(pb.CommitSnapshotRequest(who=WHO, save_id=begin.save_id, extras_json='{"x": ' + deep + "}"), timeout=20)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert f"deeper than {MAX_EXTRAS_JSON_DEPTH} JSON levels" in caught.value.details()
    assert stub.Status(pb.StatusRequest(), timeout=5).root  # still serving


def test_extras_at_the_client_limit_save_and_load_through_the_daemon(daemon) -> None:
    """The worst case the client lets through (a dict with non-string keys at every level, a
    NumPy array at the bottom) fits the daemon's JSON limit and comes back equal."""
    deep = np.arange(3, dtype=np.int16)
    for level in range(MAX_EXTRAS_DEPTH):
        deep = {level: deep}
    with CheckpointClient("deep", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(2, 2), "cfg": deep}).wait_durable(timeout=60)
        loaded = {"model": torch.nn.Linear(2, 2), "cfg": None}
        assert ckpt.load(loaded) == 1
    value = loaded["cfg"]
    for level in reversed(range(MAX_EXTRAS_DEPTH)):
        value = value[level]
    assert value.dtype == np.int16 and value.tolist() == [0, 1, 2]


# --- (b) names that cannot be safetensors keys ------------------------------------------------


@pytest.mark.parametrize(
    "names, message",
    [
        ([("model/__metadata__", "model")], "'__metadata__'"),
        ([("__metadata__", "extra")], "'__metadata__'"),
        ([("model/w", "model"), ("ema/w", "model")], "tensors 'model/w' and 'ema/w' would both be stored under the safetensors key 'w'"),
        ([("model/w", "model"), ("model/w@scales", "model")], "'model/w@scales'"),
        ([("model/w", "model"), ("model/w@0", "model")], "'model/w@0'"),
    ],
)
def test_begin_save_refuses_names_that_clash_as_file_keys(daemon, names, message) -> None:
    """Refused by BeginSave, before any byte is handed over (was: by the writer, after it)."""
    stub = _stub(daemon)
    metas = [_meta(name, kind) for name, kind in names]
    with pytest.raises(grpc.RpcError) as caught:
        stub.BeginSave(pb.BeginSaveRequest(who=WHO, step=1, fingerprint="clash", tensors=metas, timeout_s=10), timeout=20)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert message in caught.value.details()
    # The same names in different groups of files do not clash.
    ok = stub.BeginSave(
        pb.BeginSaveRequest(who=WHO, step=2, fingerprint="apart", tensors=[_meta("model/w"), _meta("optimizer/w", "optimizer")], timeout_s=10),
        timeout=20,
    )
    assert ok.save_id


@pytest.mark.parametrize(
    "kind, frozen, message",
    [("model", "yes", "frozen 'yes' is not one of '', 'param', 'buffer'"), ("optimizer", "param", "only model tensors can be frozen")],
)
def test_begin_save_refuses_a_bad_frozen_class(daemon, kind: str, frozen: str, message: str) -> None:
    meta = pb.TensorMeta(name=f"{kind}/w", kind=kind, dtype="F32", shape=(4,), box=pb.Box(offsets=(0,), lengths=(4,)), frozen=frozen)
    with pytest.raises(grpc.RpcError) as caught:
        _stub(daemon).BeginSave(pb.BeginSaveRequest(who=WHO, step=1, fingerprint="frozen", tensors=[meta], timeout_s=10), timeout=20)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details(), caught.value.details()


def test_the_client_refuses_a_tensor_named_like_the_safetensors_metadata(daemon) -> None:
    with pytest.raises(InvalidNameError, match="__metadata__"):
        check_tensor_name("model/__metadata__")
    check_tensor_name("model/metadata")
    with CheckpointClient("meta", address=daemon.address, on_error="raise") as ckpt:
        with pytest.raises(ValueError, match="reserves for a file's metadata"):
            ckpt.save(1, {"model": torch.nn.Linear(2, 2), "__metadata__": torch.zeros(4)}).wait_durable(timeout=60)
        assert ckpt.latest() is None


# --- (c) a shard deleted under a load through shared memory -----------------------------------


def test_a_deleted_shard_loaded_through_shared_memory_names_the_file(daemons) -> None:
    daemon = daemons.start()
    with CheckpointClient("gone", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)}).wait_durable(timeout=60)
        ckpt.save(2, {"model": torch.nn.Linear(4, 4)}).wait_durable(timeout=60)
    shard = daemons.root / "gone" / "step-00000002" / "model-00001-of-00001.safetensors"
    shard.unlink()
    daemon.stop()  # nothing of step 2 left in memory: every byte comes from disk
    daemon = daemons.start()
    with CheckpointClient("gone", address=daemon.address, on_error="raise", read_files=False) as ckpt:
        with pytest.raises(Exception) as caught:
            ckpt.load({"model": torch.nn.Linear(4, 4)}, step=2)
        message = str(caught.value)
        assert "INTERNAL" not in message and "FileNotFoundError" not in message, message
        assert f"{shard} is missing" in message and "load(state, step=1)" in message, message
        assert f"ckptd verify {shard.parent}" in message, message
        assert ckpt.load({"model": torch.nn.Linear(4, 4)}, step=1) == 1  # the older step still loads
    assert not list(daemons.shm_dir.glob("*-fetch-*"))  # no staging copy left behind
    assert _stub(daemon).Status(pb.StatusRequest(), timeout=5).root


# --- (d) a load into a target whose elements share memory -------------------------------------


@pytest.mark.parametrize("restarted", [False, True])
def test_a_load_into_an_expanded_view_is_refused_before_anything_is_written(daemons, restarted: bool) -> None:
    """Found by an attacker's probe: torch's own error ("more than one element of the written-to
    tensor refers to a single memory location"), raised in the middle of the fill, after other
    tensors of the state had been overwritten. From memory (the saving client) and from disk."""
    daemon = daemons.start()
    saved = {"model": {"a": torch.arange(6.0), "w": torch.arange(12.0).reshape(4, 3)}}
    with CheckpointClient("expanded", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, saved).wait_durable(timeout=60)
        if restarted:
            daemon.stop()
            daemon = daemons.start()
        target = {"model": {"a": torch.full((6,), -1.0), "w": torch.zeros(3).expand(4, 3)}}
        with pytest.raises(CheckpointError, match=r"cannot load into 'model/w'.*share memory.*strides \[0, 1\].*nothing was loaded"):
            ckpt.load(target, step=1)
        assert torch.equal(target["model"]["a"], torch.full((6,), -1.0))  # untouched
        fine = {"model": {"a": torch.zeros(6), "w": torch.zeros(4, 3)}}
        assert ckpt.load(fine, step=1) == 1 and all(torch.equal(fine["model"][k], v) for k, v in saved["model"].items())


# --- (e) a load of a state with keys the step was saved without ------------------------------


def test_a_key_the_step_lacks_is_refused_before_anything_is_written(daemons) -> None:
    """Found by a probe: resuming with code that added a key (an extras dict, a stateful object)
    raised only after the fill had overwritten the model and a fresh optimizer's state; and a
    step saved from a module could not be loaded into a plain dict of its tensors."""
    daemon = daemons.start()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    trained = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    trained.step()
    with CheckpointClient("added-keys", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model, "optimizer": trained}).wait_durable(timeout=60)
        fresh = torch.nn.Linear(3, 2)
        with torch.no_grad():
            fresh.weight.fill_(-1.0)
        optimizer = torch.optim.Adam(fresh.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)  # a stateful object added since the save
        for added in ({"extra": {"epoch": 0}}, {"scheduler": scheduler}, {"extra": {"epoch": 0}, "scheduler": scheduler}):
            with pytest.raises(CheckpointError, match=r"step 1 has no value for 'extra'|step 1 has no value for 'scheduler'") as refused:
                ckpt.load({"model": fresh, "optimizer": optimizer, **added}, step=1)
            assert "nothing was loaded" in str(refused.value) and isinstance(refused.value, ValueError)
            assert torch.equal(fresh.weight.detach(), torch.full((2, 3), -1.0)) and not optimizer.state
        kept = {"model": fresh, "optimizer": optimizer, "extra": {"epoch": 0}}
        assert ckpt.load(kept, step=1, strict=False) == 1 and kept["extra"] == {"epoch": 0}
        assert torch.equal(fresh.weight.detach(), model.weight.detach())
        plain = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}}
        assert ckpt.load(plain, step=1) == 1
        assert torch.equal(plain["model"]["weight"], model.weight.detach()) and torch.equal(plain["model"]["bias"], model.bias.detach())


def test_a_state_without_a_tensor_is_refused_saying_what_to_add(daemon) -> None:
    """Found by a probe: every save of a state of plain values failed, under on_error="warn"
    too, with the daemon's "unknown fingerprint: send the tensor metadata with this request"."""
    for on_error in ("warn", "raise"):
        with CheckpointClient(f"no-tensor-{on_error}", address=daemon.address, on_error=on_error) as ckpt:
            with pytest.raises(ValueError, match="state holds no tensor: .*add them to the state"):
                ckpt.save(1, {"extra": {"epoch": 3}, "model": torch.nn.Identity()})
            assert ckpt.latest() is None
