"""The daemon's --save-timeout is the upper bound of every save: a client's timeout_s may ask for
less, never for more. A rank that never arrives, or arrives and never hands its snapshot over,
fails the step within the daemon's setting, and the step's arenas are free for the next save
(issue 20, finding 5)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient, CheckpointError
from ckptd.wire.v1 import checkpoint_pb2 as pb

JOB = "timeouts"
CLIENT_TIMEOUT_S = 600.0  # the client's default: far longer than any wait below


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))}


def _in_thread(fn: Callable[[], Any], limit_s: float) -> tuple[Any, BaseException | None, float]:
    """Run fn in a daemon thread (a call that hangs must not hold the test process at exit);
    returns (result, exception, seconds), or fails the test when fn is not done in limit_s."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    seconds = time.monotonic() - started
    assert not thread.is_alive(), f"still waiting after {seconds:.0f} s: the daemon's --save-timeout did not apply"
    return out.get("result"), out.get("error"), seconds


def _client(address: str, rank: int, timeout_s: float = CLIENT_TIMEOUT_S) -> CheckpointClient:
    return CheckpointClient(JOB, address=address, rank=rank, world_size=2, on_error="raise", timeout_s=timeout_s)


def _save_both_ranks(address: str, step: int) -> None:
    """Both ranks save `step` (each its own client, as two trainer processes would) and it commits."""
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        with _client(address, r) as ckpt:
            results[r] = ckpt.save(step, _state()).wait_durable(timeout=60)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "the save after the timed-out one did not finish"
    assert all(info is not None and info.step == step for info in results), results


def test_a_rank_that_never_arrives_fails_the_save_within_the_daemons_save_timeout(daemons) -> None:
    daemon = daemons.start("--save-timeout", "2")
    with _client(daemon.address, 0) as ckpt:
        _, error, seconds = _in_thread(lambda: ckpt.save(1, _state()), limit_s=30)
    assert isinstance(error, CheckpointError), error
    assert error.code == "ABORTED" and "never started" in str(error) and "within 2 s" in str(error), str(error)
    assert seconds < 15, seconds
    with _client(daemon.address, 0) as ckpt:
        assert not ckpt.status().in_flight
    _save_both_ranks(daemon.address, 2)  # the job goes on


def test_a_rank_that_never_hands_over_frees_the_arenas_within_the_daemons_save_timeout(daemons) -> None:
    # one arena set per job: the next save can only start once the timed-out step gave its arenas back
    daemon = daemons.start("--save-timeout", "2", "--max-inflight", "1")
    rank0, rank1 = _client(daemon.address, 0), _client(daemon.address, 1)
    try:
        # the replicated model's tensors, described by hand (what rank 1's client would send)
        metas = [
            pb.TensorMeta(name=f"model/{name}", kind="model", dtype="F32", shape=list(value.shape))
            for name, value in _state()["model"].state_dict().items()
        ]
        request = pb.BeginSaveRequest(who=rank1._rpc.who, step=1, fingerprint="rank1-by-hand", tensors=metas, timeout_s=CLIENT_TIMEOUT_S)
        # rank 1 joins the save (as a rank that then hangs or dies would) and never commits
        joined = threading.Thread(target=lambda: rank1._rpc.stub.BeginSave(request, timeout=60), daemon=True)
        joined.start()
        handle = rank0.save(1, _state())
        joined.join(30)
        assert handle.ok and not joined.is_alive()
        arenas = daemons.arenas()
        assert arenas
        _, error, seconds = _in_thread(lambda: handle.wait_durable(timeout=60), limit_s=40)
        assert isinstance(error, CheckpointError) and "ranks [1] did not hand their snapshot over within 2 s" in str(error), error
        assert seconds < 15, seconds
    finally:
        rank0.close()
        rank1.close()
    _save_both_ranks(daemon.address, 2)
    assert daemons.arenas() == arenas  # the same arenas, given back and reused


@pytest.mark.parametrize("client_s, daemon_s", [(2.0, "60")])
def test_a_client_may_ask_for_less_than_the_daemons_save_timeout(daemons, client_s: float, daemon_s: str) -> None:
    daemon = daemons.start("--save-timeout", daemon_s)
    with _client(daemon.address, 0, timeout_s=client_s) as ckpt:
        _, error, seconds = _in_thread(lambda: ckpt.save(1, _state()), limit_s=30)
    assert isinstance(error, CheckpointError) and "within 2 s" in str(error), error
    assert seconds < 15, seconds
