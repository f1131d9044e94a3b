"""ArenaWarmup: a new client maps its rank's part of the held snapshot and fills its page tables
on its own thread; every failure ends it quietly, and stop ends it at once."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import grpc
import torch
import pytest

from ckptd.client import CheckpointClient, CheckpointError, arena_warm
from ckptd.client.arena_warm import ArenaWarmup
from ckptd.client.arenas import ArenaMaps
from ckptd.wire.v1 import checkpoint_pb2 as pb

MiB = 1 << 20


class _Unimplemented(grpc.RpcError):
    def details(self) -> str:
        return "Method not found!"


class _Future:
    """A HeldArena call: answers `reply` (or raises `error`) once `answered` is set, unless cancelled."""

    def __init__(self, reply: pb.HeldArenaResponse | None = None, error: Exception | None = None, wait: bool = False) -> None:
        self.reply, self.error = reply, error
        self.answered = threading.Event()
        self.cancelled = False
        if not wait:
            self.answered.set()

    def result(self) -> pb.HeldArenaResponse:
        self.answered.wait(10)
        if self.cancelled:
            raise grpc.FutureCancelledError()
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply

    def cancel(self) -> bool:
        self.cancelled = True
        self.answered.set()
        return True


class _Stub:
    """The daemon's stub as the warm-up uses it: HeldArena.future, recording the requests."""

    def __init__(self, answer: _Future) -> None:
        self.answer = answer
        self.requests: list[Any] = []
        self.HeldArena = self

    def future(self, request: Any, timeout: float) -> _Future:
        self.requests.append(request)
        return self.answer


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What escaped a thread's target (threading.excepthook): the warm-up must end quietly."""
    caught: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", caught.append)
    return caught


@pytest.fixture
def arena() -> Iterator[Path]:
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="ckptd-test-") as f:
        f.write(b"\x01" * (3 * MiB))
        f.flush()
        yield Path(f.name)


def _who() -> pb.RankId:
    return pb.RankId(job="j", rank=0, world_size=1)


def test_the_ranks_part_is_mapped_and_its_pages_populated(arena: Path, monkeypatch: pytest.MonkeyPatch, thread_errors: list[Any]) -> None:
    monkeypatch.setattr(arena_warm, "POPULATE_CHUNK", MiB)  # three calls: the loop, not one call, is tested
    maps = ArenaMaps()
    who = _who()
    stub = _Stub(_Future(pb.HeldArenaResponse(step=4, path=str(arena), nbytes=2 * MiB + 5)))
    warm = ArenaWarmup(stub, who, maps)
    who.run_id = "changed later"  # the request was copied when the warm-up was made
    warm.join(10)
    assert warm.populated == 2 * MiB + 5
    assert stub.requests[0].who.run_id == "" and stub.requests[0].who.job == "j"
    assert maps.get(str(arena)) is maps.get(str(arena), 2 * MiB)  # the mapping a load copies through
    assert thread_errors == []
    maps.close()


@pytest.mark.parametrize(
    "reply, error",
    [
        (None, _Unimplemented()),  # a daemon that predates HeldArena
        (pb.HeldArenaResponse(), None),  # nothing held for this rank
        (pb.HeldArenaResponse(step=3, path="/dev/shm/ckptd-test-gone", nbytes=MiB), None),  # the arena given back since
    ],
)
def test_a_warm_up_with_nothing_to_warm_ends_quietly(reply: pb.HeldArenaResponse | None, error: Exception | None, thread_errors: list[Any]) -> None:
    maps = ArenaMaps()
    warm = ArenaWarmup(_Stub(_Future(reply, error)), _who(), maps)
    warm.join(10)
    assert warm.populated == 0 and thread_errors == []  # ended, without an error escaping its thread
    maps.close()


def test_stop_cancels_a_call_still_unanswered(thread_errors: list[Any]) -> None:
    future = _Future(wait=True)
    warm = ArenaWarmup(_Stub(future), _who(), ArenaMaps())
    warm.stop()  # would wait 10 s for the answer otherwise
    assert future.cancelled and warm.populated == 0 and thread_errors == []


def test_a_mapping_closed_by_the_client_stops_the_populate(arena: Path, monkeypatch: pytest.MonkeyPatch, thread_errors: list[Any]) -> None:
    monkeypatch.setattr(arena_warm, "POPULATE_CHUNK", MiB)
    maps = ArenaMaps()
    populate = arena_warm._copy.populate
    calls: list[int] = []

    def closing_after_one(mapping: Any, offset: int, nbytes: int) -> None:
        calls.append(offset)
        populate(mapping, offset, nbytes)
        maps.close()  # as the client's close would, between two chunks

    monkeypatch.setattr(arena_warm._copy, "populate", closing_after_one)
    warm = ArenaWarmup(_Stub(_Future(pb.HeldArenaResponse(step=1, path=str(arena), nbytes=3 * MiB))), _who(), maps)
    warm.join(10)
    assert calls == [0, MiB] and warm.populated == MiB  # the second call found the mapping closed: refused, and the warm-up ended
    assert thread_errors == []


def test_a_clients_first_load_stops_its_warm_up_before_it_touches_an_arena(tmp_path: Path) -> None:
    """The warm-up's mapping could otherwise unmap one the load copies through (ArenaMaps keeps
    at most MAX_MAPPINGS): the load ends it first, cancelling an answer still awaited."""
    with CheckpointClient("j", address=f"unix://{tmp_path / 'none.sock'}", on_error="raise", timeout_s=1) as client:
        client._warmup.join(10)  # its own call failed: no daemon
        pending = _Future(wait=True)
        client._warmup = ArenaWarmup(_Stub(pending), _who(), client._maps)
        with pytest.raises(CheckpointError):
            client.load({"model": {"w": torch.zeros(2)}})
        assert pending.cancelled
