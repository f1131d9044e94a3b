"""CheckpointClient's arguments are checked when it is made, with a message saying what to pass."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ckptd.client import CheckpointClient, ClientOptions
from ckptd.client.layout import LayoutRules


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "fast"}, "mode='fast': use one of"),
        ({"on_error": "ignore"}, "on_error='ignore': use 'warn' or 'raise'"),
        ({"rank": 2, "world_size": 2}, r"rank 2 is not in \[0, world_size=2\)"),
        ({"local_world_size": 3, "rank": 0, "world_size": 2}, "local_world_size=3 must be between 1 and world_size=2"),
        ({"read_files": "yes"}, "read_files='yes': use None"),
        ({"layout": LayoutRules([])}, r"layout rules need coords=RankCoords"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_pass(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointClient("job", address="unix:///nonexistent.sock", **{"rank": 0, "world_size": 1, **kwargs})


def test_options_made_up_front_are_taken_and_not_mixed_with_keywords() -> None:
    options = ClientOptions(address="unix:///nonexistent.sock", rank=1, world_size=2, on_error="raise", timeout_s=5)
    with CheckpointClient("job", options=options) as ckpt:
        assert (ckpt.options, ckpt.rank, ckpt.world_size, ckpt.on_error, ckpt.timeout_s) == (options, 1, 2, "raise", 5.0)
    with pytest.raises(TypeError, match="either as keywords or as options=ClientOptions"):
        CheckpointClient("job", options=options, mode="copy")
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):  # what depends on the process: checked by the client
        CheckpointClient("job", options=ClientOptions(address="unix:///nonexistent.sock", rank=2, world_size=2))


def test_a_bad_job_id_is_refused() -> None:
    with pytest.raises(ValueError, match="job"):
        CheckpointClient("bad/job", address="unix:///nonexistent.sock", rank=0, world_size=1)


# issue 30 finding 11
def test_issue30_finding11_an_address_that_is_no_socket_is_refused_with_what_to_write(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"'localhost:50051' is not a Unix socket.*unix:///path/to/ckptd.sock"):
        CheckpointClient("job", address="localhost:50051", rank=0, world_size=1)
    monkeypatch.setenv("CKPTD_ADDRESS", "node0:7000")
    with pytest.raises(ValueError, match=r"'node0:7000' is not a Unix socket.*set CKPTD_ADDRESS"):
        CheckpointClient("job", rank=0, world_size=1)


def test_issue30_finding11_a_sockets_bare_path_saves_and_loads(daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    socket = daemon.address.removeprefix("unix://")
    monkeypatch.setenv("CKPTD_ADDRESS", socket)  # as `ckptd serve --socket` was given it
    with CheckpointClient("bare-path", rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.address == daemon.address
        assert ckpt.save(1, {"model": {"w": torch.ones(3)}}).wait_durable(timeout=60) is not None
    state = {"model": {"w": torch.zeros(3)}}
    with CheckpointClient("bare-path", address=socket, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.load(state) == 1
    assert state["model"]["w"].tolist() == [1.0] * 3


class _Part:
    """A stand-in for one of a client's parts: records which thread closed it; may fail."""

    def __init__(self, closed: list[str], name: str, fails: bool = False) -> None:
        self.closed, self.name, self.fails = closed, name, fails

    def close(self, *args: object, **kwargs: object) -> None:
        self.closed.append(f"{self.name} on {threading.current_thread().name}")
        if self.fails:
            raise OSError(f"{self.name} failed")

    stop = shutdown = close


def test_close_closes_every_part_even_when_one_fails_and_raises_the_first_failure() -> None:
    from ckptd.client.client import _close

    closed: list[str] = []
    parts = [_Part(closed, n, fails=n in ("handoff", "maps")) for n in ("warmup", "handoff", "pool", "maps", "rpc")]
    with pytest.raises(OSError, match="handoff failed"):
        _close(os.getpid(), *parts)  # type: ignore[arg-type]
    assert [c.split(" on ")[0] for c in closed] == ["warmup", "handoff", "pool", "maps", "rpc"]


def test_close_on_one_of_the_clients_own_threads_runs_on_another() -> None:
    """A client's last reference may go on its commit thread (its callback done): closing there,
    the commit pool would join the thread it runs on (RuntimeError) and nothing after it closed."""
    from ckptd.client.client import THREAD_PREFIX, _close

    closed: list[str] = []
    parts = [_Part(closed, n) for n in ("warmup", "handoff", "pool", "maps", "rpc")]
    own = threading.Thread(target=_close, args=(os.getpid(), *parts), name=f"{THREAD_PREFIX}commit_0")
    own.start()
    own.join(10)
    deadline = time.monotonic() + 10
    while len(closed) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(closed) == 5 and all(not c.endswith(f"{THREAD_PREFIX}commit_0") for c in closed), closed
    _close(os.getpid() + 1, *parts)  # type: ignore[arg-type]  # a forked child: nothing
    assert len(closed) == 5
