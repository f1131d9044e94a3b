"""The bulk channel: replica bytes between daemons on a TCP port of their own, beside gRPC.

Replicas of a node's part in a peer's memory (the replica tiers REPLICA_HERE and REPLICA_PEER, docs/architecture.md §9) move bytes by
the gigabyte: a push after each commit, and a restore of a lost node. gRPC in Python moved at
most about 0.9 GB/s per daemon on the test VM (by-hand measurements, docs/architecture.md §9),
whatever the message size or the number of streams (its per-message work runs on the event
loop), about a cold disk read there;
a plain socket moves the same bytes in threads, nothing on the event loop: a holder serving
ranges sends them with `sendfile`, a receiver `recv_into`s a reused buffer, checks it against
the step's checksums (units.UnitCheck) and `pwrite`s it to shared memory; a push after a commit reads its files through the storage backend in paced
slices (one copy into Python bytes per slice) and `sendall`s them.

Only bytes travel here; every decision travels on the Peer service, which is authenticated (the
peer token) and encrypted when mutual TLS is configured. The Peer call that asks for a transfer
(OfferReplica, ReadReplica) is answered with a ticket: 32 random bytes, good for one connection
within TICKET_TTL_S. One transfer per connection:

    caller -> holder   MAGIC + ticket (36 bytes)
    a SEND ticket      holder -> caller: the ticket's byte ranges, back to back; then it closes
    a RECEIVE ticket   caller -> holder: the bytes the ticket expects, back to back; then
                       holder -> caller: a status byte (0 taken, 1 refused), a u32 length, a UTF-8 reason

A connection whose first 36 bytes are not a live ticket is closed without a byte sent. The
opening is read by the port's accept thread under a short deadline, before any transfer thread
is taken (tiers/bulk_gate.py: caps per source address, keeps accepting when descriptors run out, the
port's health). With mutual TLS on the peer port (`--peer-tls-*`), the bulk port uses the same
certificates: each side checks the other's against the CA, and the caller checks the host name
it dialled.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ckptd.format.units import UnitCheck
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.records import BulkPortStatus
from ckptd.daemon.thread_priority import BackgroundPriority
from ckptd.daemon.tiers.bulk_gate import Gate, PortHealth

log = logging.getLogger(__name__)

MAGIC = b"CKB1"
TICKET_BYTES = 32
TICKET_TTL_S = 30.0  # a ticket not presented within this is dropped (its on_expire runs)
IDLE_TIMEOUT_S = 30.0  # a connection that moves no byte for this long is closed
BUFFER_BYTES = 8 * 2**20  # one receive buffer per connection
CONNECTIONS = 16  # transfers served at once (connections with a valid ticket); more wait for a thread
STATUS = struct.Struct("<BI")


class BulkError(Exception):
    """A bulk transfer did not complete: the peer closed early, refused, or did not answer."""


Transfer = Callable[[socket.socket], None]  # runs in the connection's thread with the caller's socket


@dataclass
class _Ticket:
    run: Transfer
    expires: float  # monotonic seconds
    on_expire: Callable[[], None] | None


class BulkServer:
    """The bulk port of this daemon: a listening socket, its accept thread (bulk_gate.Gate: the
    openings) and a pool of transfer threads for connections with a valid ticket. Tickets are
    issued from any thread (the event loop issues them while answering Peer calls); each is used
    once."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None, metrics: Metrics | None = None,
                 priority: BackgroundPriority | None = None) -> None:
        """priority: what the transfer threads run at (`--background-nice` and friends; None: unchanged)."""
        self.host = host
        self._requested_port = port
        self._tls = tls
        self._metrics = metrics
        self._tickets: dict[bytes, _Ticket] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        initializer = priority.initializer() if priority is not None else None
        self._pool = ThreadPoolExecutor(CONNECTIONS, thread_name_prefix="ckptd-bulk", initializer=initializer)
        self._gate: Gate | None = None
        self.port = 0

    def start(self) -> None:
        """Listen on (host, port); raises OSError naming the address when that fails."""
        family = socket.AF_INET6 if ":" in self.host.strip("[]") else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host.strip("[]"), self._requested_port))
        except OSError as exc:
            listener.close()
            raise OSError(
                exc.errno, f"cannot listen on {self.host}:{self._requested_port} for replica bytes (--replica-port): {exc.strerror}"
            ) from None
        listener.listen(128)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._gate = Gate(listener, self._tls, len(MAGIC) + TICKET_BYTES, self._admit, self._drop_expired, PortHealth(self.port, self._metrics))
        self._gate.start()

    def status(self) -> BulkPortStatus:
        """The port's health for `ckptd status` (bulk_gate.PortHealth)."""
        if self._gate is None:
            return BulkPortStatus(self.port, False, "not listening", 0, 0, 0)
        return self._gate.health.status(self._gate.running)

    def issue(self, run: Transfer, on_expire: Callable[[], None] | None = None, ttl_s: float = TICKET_TTL_S) -> bytes:
        """A ticket for one connection that runs `run` with the caller's socket. on_expire runs
        (in the accept thread) when the ticket is never presented within ttl_s."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._tickets[ticket] = _Ticket(run, time.monotonic() + ttl_s, on_expire)
        return ticket

    def _take(self, ticket: bytes) -> _Ticket | None:
        with self._lock:
            found = self._tickets.pop(ticket, None)
        return found if found is not None and found.expires >= time.monotonic() else None

    def _drop_expired(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [t for t, v in self._tickets.items() if v.expires < now]
            dropped = [self._tickets.pop(t) for t in expired]
        for ticket in dropped:
            if ticket.on_expire is not None:
                _run_logged(ticket.on_expire, "an expired bulk ticket's clean-up")

    def _admit(self, conn: socket.socket, opening: bytes) -> bool:
        """(accept thread) A connection's opening has arrived: its transfer goes to a thread when
        it presents a live ticket; False (the gate closes it) otherwise."""
        ticket = self._take(opening[len(MAGIC):]) if opening[: len(MAGIC)] == MAGIC else None
        if ticket is None:
            return False
        conn.settimeout(IDLE_TIMEOUT_S)
        try:
            self._pool.submit(self._serve, conn, ticket)
        except RuntimeError:  # the pool is shut down: closing
            conn.close()
        return True

    def _serve(self, conn: socket.socket, ticket: _Ticket) -> None:
        try:
            ticket.run(conn)
        except (OSError, BulkError) as exc:
            log.warning("bulk port: a transfer ended early: %s", exc)
        except Exception:
            log.exception("bulk port: a transfer failed")
        finally:
            conn.close()

    def close(self) -> None:
        """Stop listening, wait for the transfers under way, drop the tickets (running their on_expire)."""
        if self._gate is not None:
            self._gate.stop()
        if self._listener is not None:
            self._listener.close()
        self._pool.shutdown(wait=True)
        with self._lock:
            left = list(self._tickets.values())
            self._tickets.clear()
        for ticket in left:
            if ticket.on_expire is not None:
                _run_logged(ticket.on_expire, "a bulk ticket's clean-up at shutdown")


def _run_logged(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception:
        log.exception("%s failed", what)


def tls_contexts(cert: Path, key: Path, ca: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for mutual TLS on the bulk port, from the peer port's PEM files."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.load_verify_locations(cafile=str(ca))
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the certificate and the host name
    client.load_cert_chain(cert, key)
    client.load_verify_locations(cafile=str(ca))
    return server, client


def connect(host: str, port: int, ticket: bytes, tls: ssl.SSLContext | None, timeout_s: float = IDLE_TIMEOUT_S) -> socket.socket:
    """A connection to a holder's bulk port that has presented `ticket`."""
    try:
        sock = socket.create_connection((host.strip("[]"), port), timeout=timeout_s)
    except OSError as exc:
        raise BulkError(f"cannot connect to the bulk port {host}:{port}: {exc.strerror or exc}") from None
    try:
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host.strip("[]"))
        sock.sendall(MAGIC + ticket)
    except (OSError, ssl.SSLError) as exc:
        sock.close()
        raise BulkError(f"the bulk port {host}:{port} refused the connection: {exc}") from None
    return sock


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Exactly nbytes (small reads: tickets, status); BulkError when the peer closes first."""
    data = bytearray()
    while len(data) < nbytes:
        more = sock.recv(nbytes - len(data))
        if not more:
            raise BulkError(f"the peer closed the connection after {len(data)} of {nbytes} bytes")
        data += more
    return bytes(data)


def recv_into_file(sock: socket.socket, fd: int, offset: int, nbytes: int, buffer: memoryview, check: UnitCheck | None = None) -> None:
    """Receive exactly nbytes and write them at `offset` of fd, each buffer fed to `check` (its
    position: `offset`) before it is written (move_into_file); BulkError when the peer closes first."""
    done = move_into_file(lambda view, _: sock.recv_into(view), fd, offset, nbytes, buffer, check)
    if done < nbytes:
        raise BulkError(f"the peer closed the connection after {done} of {nbytes} bytes")


def move_into_file(
    read_into: Callable[[memoryview, int], int], fd: int, offset: int, nbytes: int, buffer: memoryview, check: UnitCheck | None = None
) -> int:
    """Move bytes [offset, offset + nbytes) of a source (a socket, a replica file) to the same
    offsets of fd (a file in shared memory: a replica or a staging file). `read_into(view, at)`
    puts the source's next bytes (those at `at`) at the start of `view` and returns how many, 0
    where the source ended. The buffer is filled before each write, so a write moves up to
    len(buffer) bytes, and fed to `check` before it is written: passing bytes are checked once,
    never read back. Returns the bytes moved: nbytes, or fewer where the source ended."""
    done = 0
    while done < nbytes:
        want = min(len(buffer), nbytes - done)
        got = 0
        while got < want and (n := read_into(buffer[got:want], offset + done + got)):
            got += n
        if check is not None:
            check.feed(buffer[:got])
        written = 0
        while written < got:
            written += os.pwrite(fd, buffer[written:got], offset + done + written)
        done += got
        if got < want:
            break
    return done


def send_file_ranges(sock: socket.socket, ranges: Iterable[tuple[int, int, int]]) -> int:
    """Send (fd, offset, nbytes) ranges back to back (the kernel copies: sendfile, or send under
    TLS); returns the bytes sent. BulkError when a file ends early."""
    sent = 0
    for fd, offset, nbytes in ranges:
        with os.fdopen(os.dup(fd), "rb") as f:
            done = sock.sendfile(f, offset, nbytes)
        if done != nbytes:
            raise BulkError(f"a replica file ended {nbytes - done} bytes early")
        sent += done
    return sent


def send_status(sock: socket.socket, ok: bool, reason: str = "") -> None:
    text = reason.encode()[:4000]
    sock.sendall(STATUS.pack(0 if ok else 1, len(text)) + text)


def recv_status(sock: socket.socket) -> tuple[bool, str]:
    code, length = STATUS.unpack(recv_exact(sock, STATUS.size))
    return code == 0, recv_exact(sock, length).decode(errors="replace")


class Pacer:
    """Keeps a sender at or under `rate` bytes per second (0: no limit) by sleeping between
    slices; stops early when `cancel` is set."""

    def __init__(self, rate: int, cancel: threading.Event | None = None) -> None:
        self.rate = rate
        self.cancel = cancel or threading.Event()
        self._start = time.monotonic()
        self._sent = 0

    def slice_bytes(self, default: int) -> int:
        """How much to send between two checks: a tenth of a second's worth when limited."""
        return default if not self.rate else max(64 * 1024, min(default, self.rate // 10))

    def sent(self, nbytes: int) -> None:
        """Count nbytes and sleep until the rate allows more; BulkError when cancelled."""
        self._sent += nbytes
        if self.rate:
            ahead = self._sent / self.rate - (time.monotonic() - self._start)
            if ahead > 0 and self.cancel.wait(ahead):
                raise BulkError("cancelled")
        if self.cancel.is_set():
            raise BulkError("cancelled")


def send_chunks(sock: socket.socket, chunks: Iterable[bytes | memoryview], pacer: Pacer) -> int:
    """Send each chunk in turn at the pacer's rate; returns the bytes sent."""
    total = 0
    for chunk in chunks:
        sock.sendall(chunk)
        total += len(chunk)
        pacer.sent(len(chunk))
    return total


def split_evenly(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indexes of `sizes` in up to `parts` groups of about equal sums (largest first into the
    lightest group); every index in exactly one group, none empty."""
    groups: list[tuple[int, list[int]]] = [(0, []) for _ in range(max(1, min(parts, len(sizes))))]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, members = min(groups, key=lambda g: g[0])
        groups.remove((load, members))
        groups.append((load + sizes[i], members + [i]))
    return [sorted(members) for _, members in groups if members]
