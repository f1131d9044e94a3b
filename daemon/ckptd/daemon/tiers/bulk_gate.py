"""The front door of the bulk port (tiers/bulk.py): one thread accepts connections and reads each
one's opening (MAGIC + ticket) without blocking, under a deadline; only a connection whose
opening has arrived is handed on (`admit`), so connections that never present a ticket hold no
transfer thread and cannot keep real transfers waiting.

Bounds, all on connections that have not presented a ticket yet (anyone who can reach the port
can open them; a real transfer presents its ticket at once):

- OPENING_TIMEOUT_S to send the opening (and finish the TLS handshake), else closed;
- MAX_OPENING_PER_SOURCE per source address and MAX_OPENING in all: past either, the oldest is
  closed to make room (a real sender's opening arrives with its connection, so it is read before
  it can become the oldest).

Running out of descriptors (EMFILE, ENFILE) or kernel memory (ENOBUFS, ENOMEM) does not stop the
port: the oldest unauthenticated connection is closed to free a descriptor, accepting pauses
(50 ms, doubling up to 1 s) and resumes. `PortHealth` counts what happened; the port is reported
unhealthy (`ckptd status`, `ckptd_bulk_port_healthy`) for HEALTH_WINDOW_S after a failed accept.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ckptd.common.names import decimal
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.records import BulkPortStatus

log = logging.getLogger(__name__)

OPENING_TIMEOUT_S = 5.0  # to present the ticket (after the TLS handshake, within the same time)
MAX_OPENING_PER_SOURCE = 16  # connections of one address without a ticket yet
MAX_OPENING = 256  # of all addresses
ACCEPT_BATCH = 64  # accepted per wake-up before the openings are read
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 1.0  # accepting pauses after a failure (no descriptors)
HEALTH_WINDOW_S = 60.0  # reported unhealthy this long after an accept failed
TICK_S = 1.0  # the thread wakes at least this often (expired tickets, the health gauge)
LOG_EVERY_S = 10.0  # refusals are logged as one summary per this many seconds
_NO_ROOM = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_REFUSALS = ("no-ticket", "timeout", "per-source", "too-many", "closed")

Admit = Callable[[socket.socket, bytes], bool]  # (connection, opening) -> taken (else it is closed)


@dataclass
class _Opening:
    """A connection that has not presented its ticket yet."""

    sock: socket.socket
    source: str
    deadline: float  # monotonic seconds
    handshaking: bool  # TLS: the handshake is not done yet
    data: bytearray = field(default_factory=bytearray)


class PortHealth:
    """What the bulk port went through; read from any thread."""

    def __init__(self, port: int, metrics: Metrics | None) -> None:
        self.port = port
        self._metrics = metrics
        self._lock = threading.Lock()
        self.accept_errors = 0
        self._recent_errors: list[float] = []  # monotonic times of failed accepts within HEALTH_WINDOW_S
        self._last_error = ""
        self.refused: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._unlogged_sources: Counter[str] = Counter()
        self._logged_at = 0.0
        self.opening = 0
        if metrics is not None:
            for reason in _REFUSALS:
                metrics.bulk_refused.labels(reason)
            metrics.bulk_port_healthy.set(1)

    def accept_failed(self, exc: OSError) -> None:
        now = time.monotonic()
        with self._lock:
            self.accept_errors += 1
            self._recent_errors.append(now)
            first = len(self._recent_errors) == 1
            self._last_error = f"[Errno {exc.errno}] {exc.strerror or exc}"
        if self._metrics is not None:
            self._metrics.bulk_accept_errors.inc()
            self._metrics.bulk_port_healthy.set(0)
        if first:
            log.error("bulk port %s: accepting a connection failed: %s; %s", self.port, self._last_error, _advice(exc.errno))

    def refuse(self, reason: str, source: str) -> None:
        with self._lock:
            self.refused[reason] += 1
            self._unlogged[reason] += 1
            self._unlogged_sources[source] += 1
        if self._metrics is not None:
            self._metrics.bulk_refused.labels(reason).inc()

    def tick(self, opening: int) -> None:
        """Once a second or more (the gate's thread): forget old failures, log refusals in one
        summary line, update the health gauge."""
        now = time.monotonic()
        with self._lock:
            self.opening = opening
            had = bool(self._recent_errors)
            self._recent_errors = [t for t in self._recent_errors if now - t < HEALTH_WINDOW_S]
            recovered = had and not self._recent_errors
            summary = ""
            if self._unlogged and now - self._logged_at >= LOG_EVERY_S:
                sources = ", ".join(f"{s} ({n})" for s, n in self._unlogged_sources.most_common(3))
                summary = f"{', '.join(f'{n} {r}' for r, n in sorted(self._unlogged.items()))} from {sources}"
                self._unlogged.clear()
                self._unlogged_sources.clear()
                self._logged_at = now
        if summary:
            log.warning("bulk port %s: closed connections that presented no valid ticket in time: %s", self.port, summary)
        if recovered:
            log.info("bulk port %s: accepting connections again, no failure for %.0f s", self.port, HEALTH_WINDOW_S)
        if self._metrics is not None:
            self._metrics.bulk_port_healthy.set(0 if self._recent_errors else 1)

    def status(self, gate_running: bool) -> BulkPortStatus:
        now = time.monotonic()
        with self._lock:
            recent = [t for t in self._recent_errors if now - t < HEALTH_WINDOW_S]
            problem = ""
            if recent:
                problem = (
                    f"accepting failed {len(recent)} times in the last {HEALTH_WINDOW_S:.0f} s, last {now - recent[-1]:.0f} s ago: "
                    f"{self._last_error}; {_advice(None if not self._last_error else _errno_of(self._last_error))}"
                )
            if not gate_running:
                problem = "its accept thread is not running: replicas cannot be pushed to or read from this node; restart the daemon"
            return BulkPortStatus(self.port, not problem, problem, self.accept_errors, sum(self.refused.values()), self.opening)


def _errno_of(text: str) -> int | None:
    digits = text.removeprefix("[Errno ").split("]", 1)[0]
    return decimal(digits)


def _advice(code: int | None) -> str:
    if code in (errno.EMFILE, errno.ENFILE):
        return ("the daemon ran out of file descriptors (raise its limit: LimitNOFILE= in the systemd unit, ulimit -n; "
                "or find who holds connections open to this port); it keeps accepting as descriptors free up")
    return "it keeps retrying"


class Gate:
    """The accept thread of a listening socket: openings read under a deadline, connections with
    a complete opening handed to `admit`."""

    def __init__(self, listener: socket.socket, tls: ssl.SSLContext | None, opening_bytes: int, admit: Admit,
                 on_tick: Callable[[], None], health: PortHealth) -> None:
        self._listener = listener
        self._tls = tls
        self._opening_bytes = opening_bytes
        self._admit = admit
        self._on_tick = on_tick
        self.health = health
        self._openings: OrderedDict[int, _Opening] = OrderedDict()  # by descriptor, oldest first
        self._by_source: dict[str, OrderedDict[int, None]] = {}
        self._selector = selectors.DefaultSelector()
        self._stopping = threading.Event()
        self._backoff = 0.0
        self._listening, self._resume_at, self._ticked = True, 0.0, 0.0
        self.thread = threading.Thread(target=self._run, name="ckptd-bulk-accept", daemon=True)

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self.thread.start()

    def stop(self) -> None:
        """Stop accepting and close every connection still without a ticket (closing the
        listener is the caller's, after this)."""
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread at once (Linux)
        except OSError as exc:
            log.debug("bulk port: shutdown of the listener: %s", exc)
        if self.thread.is_alive():
            self.thread.join(5.0)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._turn()
                except Exception:  # a bug must not end the port for good: log it and go on
                    log.exception("bulk port %s: unexpected error in the accept thread; it goes on", self.health.port)
                    time.sleep(BACKOFF_FIRST_S)
        finally:
            for opening in list(self._openings.values()):
                self._drop(opening, None)
            self._selector.close()

    def _turn(self) -> None:
        """Wait for the listener, the openings or the next deadline (at most TICK_S), and act."""
        now = time.monotonic()
        if not self._listening and now >= self._resume_at:
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._listening = True
        oldest = next(iter(self._openings.values()), None)  # openings share one timeout: the oldest expires first
        wait = min(TICK_S, oldest.deadline - now if oldest is not None else TICK_S, self._resume_at - now if not self._listening else TICK_S)
        for key, _ in self._selector.select(max(0.0, wait)):
            if key.fileobj is self._listener:
                if self._listening and not self._accept_some():
                    self._selector.unregister(self._listener)
                    self._listening, self._resume_at = False, time.monotonic() + self._backoff
            elif key.data is not None and key.fd in self._openings:
                self._advance(key.data)
        self._expire(time.monotonic())
        if time.monotonic() - self._ticked >= TICK_S:
            self._ticked = time.monotonic()
            self._on_tick()
            self.health.tick(len(self._openings))

    def _accept_some(self) -> bool:
        """Accept what is waiting (up to ACCEPT_BATCH); False when accepting must pause."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, peer = self._listener.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if self._stopping.is_set():
                    return True
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR):
                    continue  # that connection is gone; the port is fine
                self.health.accept_failed(exc)
                if exc.errno in _NO_ROOM and self._openings:
                    self._drop(next(iter(self._openings.values())), "too-many")  # a descriptor for a real transfer
                self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * self._backoff))
                return False
            self._backoff = 0.0
            self._take(conn, str(peer[0]))
        return True

    def _take(self, conn: socket.socket, source: str) -> None:
        conn.setblocking(False)
        sock: socket.socket = conn
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as exc:
                log.info("bulk port: a connection from %s could not start TLS: %s", source, exc)
                conn.close()
                return
        opening = _Opening(sock, source, time.monotonic() + OPENING_TIMEOUT_S, self._tls is not None)
        fd = sock.fileno()
        self._openings[fd] = opening
        mine = self._by_source.setdefault(source, OrderedDict())
        mine[fd] = None
        while len(mine) > MAX_OPENING_PER_SOURCE:
            self._drop(self._openings[next(iter(mine))], "per-source")
        while len(self._openings) > MAX_OPENING:
            self._drop(next(iter(self._openings.values())), "too-many")
        if fd in self._openings:
            self._selector.register(sock, selectors.EVENT_READ, opening)
            self._advance(opening)  # a sender's opening is usually there already

    def _advance(self, opening: _Opening) -> None:
        """Read what there is of the opening (after the TLS handshake); hand the connection on
        once it is complete."""
        sock = opening.sock
        try:
            if opening.handshaking:
                assert isinstance(sock, ssl.SSLSocket)
                sock.do_handshake()
                opening.handshaking = False
                self._selector.modify(sock, selectors.EVENT_READ, opening)
            while len(opening.data) < self._opening_bytes:
                chunk = sock.recv(self._opening_bytes - len(opening.data))
                if not chunk:
                    self._drop(opening, "closed")
                    return
                opening.data += chunk
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, opening)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE, opening)
            return
        except BlockingIOError:
            return
        except OSError:  # reset, a failed handshake
            self._drop(opening, "closed")
            return
        self._forget(opening)
        sock.setblocking(True)
        if not self._admit(sock, bytes(opening.data)):
            self.health.refuse("no-ticket", opening.source)
            sock.close()

    def _expire(self, now: float) -> None:
        for opening in [o for o in self._openings.values() if o.deadline <= now]:
            self._drop(opening, "timeout")

    def _forget(self, opening: _Opening) -> None:
        fd = opening.sock.fileno()
        self._openings.pop(fd, None)
        mine = self._by_source.get(opening.source)
        if mine is not None:
            mine.pop(fd, None)
            if not mine:
                del self._by_source[opening.source]
        if fd in self._selector.get_map():
            self._selector.unregister(opening.sock)

    def _drop(self, opening: _Opening, reason: str | None) -> None:
        self._forget(opening)
        if reason is not None:
            self.health.refuse(reason, opening.source)
        opening.sock.close()
