"""A restarted trainer's first load from the daemon's memory, through page tables made ahead.

A new process maps the daemon's arenas afresh, and its first copy through a mapping takes one
page fault per 4 KiB page: about 15 ms of one core per 256 MiB on the test VM, a quarter of a
restore's wall time (docs/benchmarks.md). A trainer makes its client before it builds its
model and loads, so `ArenaWarmup`, started when the client is made, asks the daemon where
this rank's part of the job's newest held snapshot lies (HeldArena), maps that arena
(`ArenaMaps`, the mapping the load then copies through) and fills its page tables on a thread
of its own, the GIL released (`ckptd.common._copy.populate`), while the trainer goes on.

A hint only: nothing is leased, the load still plans and checks everything, and the arena may
hold another step by the time it comes (the pages are then the next save's). Any failure (an
older daemon, nothing held, the arena gone) ends the warm-up quietly: the load faults the
pages in as before. The client's first save or load stops it (`stop`, within one populate
call) before it touches an arena: the warm-up's mapping never races a copy's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from ckptd.client.arenas import ArenaMaps
from ckptd.common import _copy
from ckptd.wire.v1 import checkpoint_pb2 as pb

log = logging.getLogger(__name__)

POPULATE_CHUNK = 16 * 2**20  # bytes populated per call: `stop` takes effect within one (about 1 ms)
ANSWER_TIMEOUT_S = 10.0


class ArenaWarmup:
    """Fills this process's page tables for the rank's part of the held snapshot (see the
    module docstring), on a daemon thread started here; `stop` ends it."""

    def __init__(self, stub: Any, who: pb.RankId, maps: ArenaMaps) -> None:
        """stub: the daemon's Checkpoint stub; who: this rank; maps: the client's arena mappings."""
        self._stop = threading.Event()
        self._call: Any = None  # the HeldArena future while it is awaited
        self._lock = threading.Lock()
        self.populated = 0  # bytes whose page tables were filled (tests)
        request = pb.HeldArenaRequest(who=who)  # a copy, made here: the client changes `who` later (its run id)
        self._thread = threading.Thread(target=self._run, args=(stub, request, maps), name="ckptd-warm", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the warm-up to end by itself (tests, benchmarks)."""
        self._thread.join(timeout)

    def stop(self) -> None:
        """End the warm-up (its call cancelled, at most one chunk's populate more) and wait for it."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join()

    def _run(self, stub: Any, request: pb.HeldArenaRequest, maps: ArenaMaps) -> None:
        try:
            reply = self._held_arena(stub, request)
            if reply is None or not reply.path or reply.nbytes <= 0:
                return
            mapping = maps.get(reply.path)
            end = min(reply.nbytes, len(mapping))
            for at in range(0, end, POPULATE_CHUNK):
                if self._stop.is_set():
                    return
                _copy.populate(mapping, at, min(POPULATE_CHUNK, end - at))
                self.populated += min(POPULATE_CHUNK, end - at)
        except (OSError, ValueError) as exc:  # the arena gone or replaced, or unmapped by the client's close
            log.debug("warming the held snapshot's arena stopped: %s", exc)

    def _held_arena(self, stub: Any, request: pb.HeldArenaRequest) -> pb.HeldArenaResponse | None:
        with self._lock:
            if self._stop.is_set():
                return None
            self._call = stub.HeldArena.future(request, timeout=ANSWER_TIMEOUT_S)
        try:
            reply: pb.HeldArenaResponse = self._call.result()
            return reply
        except grpc.RpcError as exc:  # an older daemon (UNIMPLEMENTED), none running yet: nothing to warm
            log.debug("no held arena to warm: %s", exc.details() if hasattr(exc, "details") else exc)
        except grpc.FutureCancelledError:
            log.debug("warming cancelled: the client closed")
        finally:
            with self._lock:
                self._call = None
        return None
