"""Tier 0b without daemons: placement, the replica store (budget, newest only, nothing partial
served), range merging and cutting, and the bulk channel's tickets and transfers."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from pathlib import Path

import pytest
import xxhash

from ckptd.daemon.tiers.bulk import MAGIC, BulkError, BulkServer, Pacer, connect, recv_into_file, recv_status, send_chunks, send_file_ranges
from ckptd.daemon.tiers.bulk import send_status, split_evenly
from ckptd.daemon.tiers.replica_store import Damaged, Refused, ReplicaStore, open_ranges
from ckptd.daemon.rpc.validate import check_replica_units
from ckptd.daemon.tiers.replica_ranges import cut_ranges, merge_ranges, units_in, units_within, widen_to_units
from ckptd.daemon.tiers.replicas import buddies
from ckptd.daemon.errors import InvalidRequest
from ckptd.daemon.errors import NotFound
from ckptd.format.index import FileRecord
from ckptd.common.chunks import checksum_name
from ckptd.format.units import Unit, UnitCheck
from ckptd.wire.v1 import peer_pb2 as ppb

# ------------------------------------------------------------------ placement


@pytest.mark.parametrize("nodes", [2, 3, 4, 7, 16])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_any_replicas_nodes_lost_every_part_is_still_held(nodes: int, replicas: int) -> None:
    holders = {n: buddies(n, nodes, replicas) for n in range(nodes)}
    assert all(n not in h and len(set(h)) == len(h) == min(replicas, nodes - 1) for n, h in holders.items())
    for lost in itertools.combinations(range(nodes), min(replicas, nodes - 1)):
        for node in range(nodes):  # the node itself, or a holder, survives
            assert node not in lost or any(h not in lost for h in holders[node]), (lost, node)
    # each node holds the same number of parts: the memory is spread evenly
    load = [sum(n in h for h in holders.values()) for n in range(nodes)]
    assert len(set(load)) == 1


def test_placement_table() -> None:
    assert buddies(0, 3, 1) == (1,)
    assert buddies(2, 3, 1) == (0,)
    assert buddies(1, 4, 2) == (2, 3)
    assert buddies(0, 2, 5) == (1,)  # capped at nodes - 1
    assert buddies(0, 1, 1) == ()  # a single node has no buddy
    assert buddies(3, 4, 0) == ()  # off


# ------------------------------------------------------------------ the store

MiB = 2**20


def safetensors_bytes(payload: bytes) -> tuple[bytes, str]:
    """A tiny file laid out as the writer lays a data file out (header, then data) and its index checksum."""
    text = b'{"__metadata__":{"format":"pt"}}'
    text += b" " * (-(len(text) + 8) % 8)
    header = struct.pack("<Q", len(text)) + text
    return header + payload, checksum_name(xxhash.xxh3_64_intdigest(header))


def records(node: int, sizes: dict[str, int]) -> list[FileRecord]:
    return [FileRecord(name, size, f"xxh3-64:{i:016x}", node) for i, (name, size) in enumerate(sizes.items())]


def offered(files: list[FileRecord], data: bytes = b"") -> tuple[list[FileRecord], dict[str, tuple[Unit, ...]]]:
    """An offer's files and checksum units: one unit over each whole file, the xxh3 of `data`
    (the one file's bytes; offers never received may give any)."""
    return files, {f.name: (Unit(0, f.size, xxhash.xxh3_64_intdigest(data)),) for f in files}


def arrive(data: bytes, fd: int, check: UnitCheck | None = None) -> None:
    """`data` arriving on a bulk connection into fd (bulk.recv_into_file), fed to `check` as it arrives."""
    sender, receiver = socket.socketpair()
    with sender, receiver:
        sending = threading.Thread(target=sender.sendall, args=(data,))
        sending.start()
        recv_into_file(receiver, fd, 0, len(data), memoryview(bytearray(64 * 1024)), check)
        sending.join()


def receive(store: ReplicaStore, receipt, contents: dict[str, bytes]) -> None:
    """What the bulk thread does with a complete transfer (Replication._receive)."""
    fds = store.create_parts(receipt)
    try:
        for record, fd in zip(receipt.files, fds):
            arrive(contents[record.name], fd, receipt.checks[record.name])
        store.check_and_rename(receipt, fds)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    return tmp_path


def test_an_offer_over_the_budget_is_refused_and_the_same_node_s_older_replica_is_evicted_first(shm: Path) -> None:
    store = ReplicaStore(shm, limit=10 * MiB)
    a = store.offer("j", 1, 5, *offered(records(1, {"f1.safetensors": 6 * MiB})))
    assert a is not None and store.nbytes == 6 * MiB
    with pytest.raises(Refused, match=r"node 2's part of step 5 .* does not fit in --replica-memory \(10 MiB"):
        store.offer("j", 2, 5, *offered(records(2, {"f2.safetensors": 5 * MiB})))
    with pytest.raises(Refused, match="larger than all of --replica-memory"):
        store.offer("j", 2, 5, *offered(records(2, {"f2.safetensors": 11 * MiB})))
    data, digest = safetensors_bytes(b"x" * 100)
    receipt = store.offer("j", 3, 5, *offered([FileRecord("f3.safetensors", len(data), digest, 3)], data))
    assert receipt is not None
    receive(store, receipt, {"f3.safetensors": data})
    assert store.publish(receipt)
    # node 1's newer part replaces its older one (being received): it fits once that one is dropped
    b = store.offer("j", 1, 6, *offered(records(1, {"f1.safetensors": 9 * MiB})))
    assert b is not None and a.cancelled and not store.publish(a)
    assert store.nbytes == 9 * MiB + len(data)


def test_another_jobs_replicas_make_room_least_recently_received_first(shm: Path) -> None:
    store = ReplicaStore(shm, limit=10 * MiB)
    for job, node in (("old", 1), ("new", 2), ("old", 2)):
        data, digest = safetensors_bytes(b"z" * (3 * MiB))
        receipt = store.offer(job, node, 1, *offered([FileRecord("m.safetensors", len(data), digest, node)], data))
        assert receipt is not None
        receive(store, receipt, {"m.safetensors": data})
        assert store.publish(receipt)
    assert store.offer("new", 1, 1, *offered(records(1, {"f.safetensors": 7 * MiB // 2}))) is not None  # 9 MiB held: one must go
    assert sorted(store.held) == [("new", 2), ("old", 2)]  # the least recently received of the other job went
    assert store.offer("new", 3, 1, *offered(records(3, {"f.safetensors": 3 * MiB}))) is not None  # then the other job's last one
    assert sorted(store.held) == [("new", 2)]
    with pytest.raises(Refused):  # the same job's other parts are never evicted for it
        store.offer("new", 3, 1, *offered(records(3, {"f.safetensors": 7 * MiB})))


def test_only_the_newest_committed_step_per_node_is_held(shm: Path) -> None:
    store = ReplicaStore(shm, limit=MiB)
    held = {}
    for step in (1, 2, 3):
        data, digest = safetensors_bytes(bytes([step]) * 1000)
        receipt = store.offer("j", 1, step, *offered([FileRecord("m.safetensors", len(data), digest, 1)], data))
        assert receipt is not None
        receive(store, receipt, {"m.safetensors": data})
        assert store.publish(receipt)
        held[step] = receipt.paths["m.safetensors"]
    assert store.files_of("j", 3) == [(1, "m.safetensors", len(data))]
    assert store.files_of("j", 2) == []
    with pytest.raises(NotFound, match="it holds step 3"):
        store.replica("j", 1, 2)
    assert not held[1].exists() and not held[2].exists() and held[3].exists()  # the older steps' memory is released
    again = store.offer("j", 1, 3, *offered([FileRecord("m.safetensors", len(data), digest, 1)], data))
    assert again is None  # held already: nothing to send
    store.close()
    assert not any(shm.iterdir())


@pytest.mark.parametrize("cut", ["nothing", "half the header", "the header only", "all but one byte", "a wrong header"])
def test_a_partial_or_wrong_replica_is_never_served(shm: Path, cut: str) -> None:
    store = ReplicaStore(shm, limit=MiB)
    data, digest = safetensors_bytes(b"payload!" * 100)
    receipt = store.offer("j", 1, 7, *offered([FileRecord("m.safetensors", len(data), digest, 1)], data))
    assert receipt is not None
    received = {
        "nothing": b"", "half the header": data[:20], "the header only": data[:40], "all but one byte": data[:-1],
        "a wrong header": b"\x30" + data[1:],
    }[cut]
    fds = store.create_parts(receipt)
    try:
        if cut == "a wrong header":
            arrive(received, fds[0], receipt.checks["m.safetensors"])
        else:  # a short stream: the bulk thread stops at the peer's close, before checking
            os.pwrite(fds[0], received, 0)
            os.ftruncate(fds[0], len(received))
        with pytest.raises(Damaged):
            store.check_and_rename(receipt, fds)
    finally:
        os.close(fds[0])
    store.abandon(receipt)
    ReplicaStore.remove_receipt_files(receipt)
    assert store.files_of("j", 7) == [] and store.nbytes == 0 and not any(shm.iterdir())
    with pytest.raises(NotFound):
        store.replica("j", 1, 7)


# issue 30 finding 11: a buddy checks every byte of a replica against the step's checksums when it arrives
@pytest.mark.parametrize("flipped", ["first payload byte", "last byte"])
def test_a_replica_whose_bytes_do_not_match_the_index_is_not_kept(shm: Path, flipped: str) -> None:
    store = ReplicaStore(shm, limit=MiB)
    data, digest = safetensors_bytes(bytes(range(256)) * 16)
    header = len(data) - 4096
    units = {"m.safetensors": (Unit(0, header, xxhash.xxh3_64_intdigest(data[:header])), Unit(header, 4096, xxhash.xxh3_64_intdigest(data[header:])))}
    receipt = store.offer("j", 2, 1, [FileRecord("m.safetensors", len(data), digest, 2)], units)
    assert receipt is not None
    damaged = bytearray(data)
    damaged[header if flipped == "first payload byte" else -1] ^= 1  # the header still matches its checksum
    with pytest.raises(Damaged, match=rf"m.safetensors arrived damaged: bytes \[{header}, {len(data)}\) do not match their checksum .*node 2's file or the transfer"):
        receive(store, receipt, {"m.safetensors": bytes(damaged)})
    store.abandon(receipt)
    ReplicaStore.remove_receipt_files(receipt)
    assert store.files_of("j", 1) == [] and not any(shm.iterdir())


# issue 30 finding 11
def test_an_offer_without_checksums_that_tile_each_file_is_refused() -> None:
    files = [FileRecord("a.safetensors", 100, "xxh3-64:0000000000000001", 1), FileRecord("b.safetensors", 50, "xxh3-64:0000000000000002", 1)]

    def entry(name: str, *units: tuple[int, int]) -> ppb.FileUnits:
        return ppb.FileUnits(name=name, units=[ppb.ChecksumUnit(offset=o, nbytes=n, xxh3=7) for o, n in units])

    good = [entry("a.safetensors", (0, 40), (40, 60)), entry("b.safetensors", (0, 50))]
    assert check_replica_units(files, good) == {"a.safetensors": (Unit(0, 40, 7), Unit(40, 60, 7)), "b.safetensors": (Unit(0, 50, 7),)}
    with pytest.raises(InvalidRequest, match="no checksums of b.safetensors"):
        check_replica_units(files, good[:1])
    with pytest.raises(InvalidRequest, match=r"a.safetensors bytes \[40, 50\) no checksum covers"):
        check_replica_units(files, [entry("a.safetensors", (0, 40), (50, 50)), good[1]])
    with pytest.raises(InvalidRequest, match="end at byte 90, the file has 100"):
        check_replica_units(files, [entry("a.safetensors", (0, 90)), good[1]])
    with pytest.raises(InvalidRequest, match="which it does not offer, or twice"):
        check_replica_units(files, [*good, entry("c.safetensors", (0, 1))])


# issue 30 finding 11: a load widens what it stages from a replica to whole checksum units, and checks them
def test_reads_of_a_replica_are_widened_to_whole_units() -> None:
    units = {"f": (Unit(0, 10, 1), Unit(10, 100, 2), Unit(110, 100, 3), Unit(210, 5, 4))}
    widened, checks = widen_to_units([("f", 20, 10, 7), ("f", 105, 10, 7), ("g", 3, 4, 8), ("f", 214, 1, 9)], units)
    assert widened == [("f", 10, 100, 7), ("f", 10, 200, 7), ("g", 3, 4, 8), ("f", 210, 5, 9)]
    assert checks == [("f", 7, Unit(10, 100, 2)), ("f", 7, Unit(110, 100, 3)), ("f", 9, Unit(210, 5, 4))]


def test_a_held_replica_is_served_by_range_and_survives_its_eviction_while_open(shm: Path) -> None:
    store = ReplicaStore(shm, limit=MiB)
    data, digest = safetensors_bytes(bytes(range(256)) * 8)
    receipt = store.offer("j", 2, 1, *offered([FileRecord("m.safetensors", len(data), digest, 2)], data))
    assert receipt is not None
    receive(store, receipt, {"m.safetensors": data})
    store.publish(receipt)
    opened = open_ranges(store.replica("j", 2, 1), [("m.safetensors", 40, 100), ("m.safetensors", 1000, 24)])
    store.evict(("j", 2), "(test)")
    try:
        assert [os.pread(fd, n, off) for fd, off, n in opened] == [data[40:140], data[1000:1024]]
    finally:
        for fd in {fd for fd, _, _ in opened}:
            os.close(fd)


# ------------------------------------------------------------------ ranges


def test_ranges_merge_within_a_file_and_cut_for_parallel_connections() -> None:
    ranges = [("b", 0, 10, 4), ("a", 100, 50, 3), ("a", 0, 100, 3), ("a", 150 + 70_000, 10, 3), ("a", 140, 5, 3)]
    assert merge_ranges(ranges) == [("a", 0, 150, 3), ("a", 70_150, 10, 3), ("b", 0, 10, 4)]
    assert merge_ranges([("a", 0, 10, 3), ("a", 10 + 1000, 10, 3)], gap=0) == [("a", 0, 10, 3), ("a", 1010, 10, 3)]
    cut = cut_ranges([("a", 0, 5 * MiB + 3, 3)], 2 * MiB)
    assert cut == [("a", 0, 2 * MiB, 3), ("a", 2 * MiB, 2 * MiB, 3), ("a", 4 * MiB, MiB + 3, 3)]
    groups = split_evenly([5, 1, 4, 3, 3], 2)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    assert sorted(sum([5, 1, 4, 3, 3][i] for i in g) for g in groups) == [8, 8]


# issue 30 review: a range is cut only between units, so that each staged unit arrives whole on
# one connection and is checked as it arrives
def test_ranges_are_cut_between_units_and_each_unit_is_checked_in_the_range_that_holds_it() -> None:
    units = {"f": (Unit(0, 10, 1), Unit(10, 3 * MiB, 2), Unit(3 * MiB + 10, MiB, 3), Unit(4 * MiB + 10, 5, 4))}
    cut = cut_ranges([("f", 0, 4 * MiB + 15, 7), ("g", 0, 3 * MiB, 8)], MiB, units=units)
    # the cut at 1 MiB falls inside unit 1: it moves to that unit's end; a file without units is cut as before
    assert cut == [("f", 0, 3 * MiB + 10, 7), ("f", 3 * MiB + 10, MiB, 7), ("f", 4 * MiB + 10, 5, 7),
                   ("g", 0, MiB, 8), ("g", MiB, MiB, 8), ("g", 2 * MiB, MiB, 8)]
    _, checks = widen_to_units([("f", 5, 20, 7), ("f", 4 * MiB + 11, 1, 7)], units)  # units 0, 1 and 3 are staged
    assert units_in(cut, checks) == [units["f"][:2], (), (units["f"][3],), (), (), ()]


# issue 34: the ranks copy what a replica tier staged without checking it again, so every byte a
# fetch writes is checked, the units that merging brings in between the reads included
@pytest.mark.parametrize(
    ("reads", "expected"),
    [
        ([("f", 0, 10, 7)], [0]),
        ([("f", 0, 10, 7), ("f", 110, 100, 7)], [0, 1, 2]),  # merged over unit 1 (100 bytes apart): it is checked too
        ([("f", 10, 100, 7), ("f", 210, 5, 7)], [1, 2, 3]),
        ([("f", 0, 10, 7), ("f", 210, 5, 9)], [0, 3]),  # other staging fds: not merged
    ],
)
def test_a_fetch_checks_every_unit_inside_its_merged_ranges(reads: list[tuple[str, int, int, int]], expected: list[int]) -> None:
    units = {"f": (Unit(0, 10, 1), Unit(10, 100, 2), Unit(110, 100, 3), Unit(210, 5, 4))}
    widened, _ = widen_to_units(reads, units)
    merged = merge_ranges(widened)
    checks = units_within(merged, units)
    assert [units["f"].index(unit) for _, _, unit in checks] == expected
    covered = sum(unit.nbytes for _, _, unit in checks)
    assert covered == sum(n for _, _, n, _ in merged)  # nothing written unchecked


# issue 30 review: the bytes a connection brings are checked before they are written, never read back
def test_bytes_received_into_a_file_are_checked_as_they_arrive(tmp_path: Path) -> None:
    data = os.urandom(3 * MiB)
    units = (Unit(0, 100, xxhash.xxh3_64_intdigest(data[:100])), Unit(100, len(data) - 100, xxhash.xxh3_64_intdigest(data[100:])))
    out = tmp_path / "out"
    out_fd = os.open(out, os.O_WRONLY | os.O_CREAT)  # write-only: a read back would fail
    try:
        check = UnitCheck(units)
        arrive(data, out_fd, check)
        assert check.problem() is None and out.read_bytes() == data
        damaged = bytearray(data)
        damaged[-1] ^= 1
        check = UnitCheck(units)
        arrive(bytes(damaged), out_fd, check)
        assert check.problem() == f"bytes [100, {len(data)}) do not match their checksum in the index"
    finally:
        os.close(out_fd)


# ------------------------------------------------------------------ the bulk channel


def test_a_ticket_serves_one_connection_and_anything_else_is_closed_unanswered(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.write_bytes(os.urandom(3 * MiB + 5))
    server = BulkServer("127.0.0.1", 0)
    server.start()
    try:
        fd = os.open(source, os.O_RDONLY)
        ticket = server.issue(lambda sock: send_file_ranges(sock, [(fd, 10, MiB), (fd, 2 * MiB, MiB + 5)]), on_expire=lambda: None)
        out = tmp_path / "out"
        out_fd = os.open(out, os.O_RDWR | os.O_CREAT)
        with connect("127.0.0.1", server.port, ticket, None) as sock:
            buffer = memoryview(bytearray(256 * 1024))
            recv_into_file(sock, out_fd, 0, MiB, buffer)
            recv_into_file(sock, out_fd, MiB, MiB + 5, buffer)
        data = source.read_bytes()
        assert out.read_bytes() == data[10 : 10 + MiB] + data[2 * MiB :]
        os.close(out_fd)
        os.close(fd)
        for opening in (MAGIC + ticket, b"GET / HTTP/1.1\r\n" + bytes(20), MAGIC + bytes(32)):  # used, foreign, unknown
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
                raw.sendall(opening)
                assert raw.recv(1) == b""  # closed without a byte
    finally:
        server.close()


def test_an_unused_ticket_expires_and_runs_its_clean_up() -> None:
    server = BulkServer("127.0.0.1", 0)
    server.start()
    expired = threading.Event()
    try:
        server.issue(lambda sock: None, on_expire=expired.set, ttl_s=0.1)
        assert expired.wait(5.0)
    finally:
        server.close()


def test_a_push_is_paced_cancellable_and_answered(tmp_path: Path) -> None:
    server = BulkServer("127.0.0.1", 0)
    server.start()
    got = bytearray()

    def take(sock: socket.socket) -> None:
        while len(got) < 4 * MiB:
            chunk = sock.recv(MiB)
            if not chunk:
                send_status(sock, False, "short")
                return
            got.extend(chunk)
        send_status(sock, True)

    try:
        ticket = server.issue(take)
        with connect("127.0.0.1", server.port, ticket, None) as sock:
            pacer = Pacer(rate=40 * MiB)
            import time

            start = time.monotonic()
            send_chunks(sock, (b"x" * pacer.slice_bytes(MiB) for _ in range(4 * MiB // pacer.slice_bytes(MiB))), pacer)
            assert time.monotonic() - start >= 0.08  # 4 MiB at 40 MiB/s: about 0.1 s
            assert recv_status(sock) == (True, "")
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(BulkError, match="cancelled"):
            Pacer(0, cancel).sent(1)
    finally:
        server.close()


# ------------------------------------------------------------------ recoverability (node 0)


@pytest.mark.parametrize(
    "answers, newest, still",
    [
        ({1: "", 2: ""}, 7, True),  # both holders keep their parts
        ({1: "", 2: "does not answer (x)"}, 7, False),  # node 1's part was on node 2 only
        ({1: "", 2: "no longer holds it"}, None, False),  # no newest known: checked all the same
        ({1: "", 2: "does not answer (x)"}, 8, True),  # step 8 committed: its pushes replace these replicas
    ],
)
def test_a_part_no_holder_keeps_makes_the_step_not_recoverable(answers: dict[int, str], newest: int | None, still: bool) -> None:
    import asyncio
    from types import SimpleNamespace

    from ckptd.daemon.tiers.replicas import Recoverability
    from ckptd.daemon.metrics import Metrics

    metrics = Metrics()
    recoverability = Recoverability(SimpleNamespace(metrics=metrics))  # type: ignore[arg-type]
    needed = frozenset({0, 1})
    recoverability.report("j", 7, needed, 0, [1], "")  # node 0's part on node 1, node 1's on node 2
    recoverability.report("j", 7, needed, 1, [2], "")
    assert recoverability.recoverable == {"j": 7}

    async def holds(holder: int, job: str, step: int, node: int) -> str:
        return answers[holder]

    asyncio.run(recoverability.recheck(holds, lambda job: newest))
    assert (recoverability.recoverable == {"j": 7}) is still
    gauge = metrics.registry.get_sample_value("ckptd_recoverable_step", {"job": "j"})
    assert gauge == (7 if still else -1)
    if not still:
        assert recoverability.problems["j"].startswith("step 7: node 1's part is no longer held by another node (node 2 ")


def test_node_0_names_where_a_nodes_part_of_each_jobs_newest_step_is_held() -> None:
    from types import SimpleNamespace

    from ckptd.daemon.metrics import Metrics
    from ckptd.daemon.tiers.replicas import Recoverability

    recoverability = Recoverability(SimpleNamespace(metrics=Metrics()))  # type: ignore[arg-type]
    for job in ("b", "a"):
        recoverability.report(job, 3, frozenset({0, 1}), 0, [1], "")
        recoverability.report(job, 3, frozenset({0, 1}), 1, [0], "")
    recoverability.report("a", 4, frozenset({0, 1}), 1, [2], "")  # step 4: node 0's part not held (yet), node 1's is
    recoverability.report("c", 5, frozenset({0}), 0, [1], "")  # node 1 wrote no data files of job c's step
    recoverability.report("d", 6, frozenset({0, 1}), 1, [], "no buddy")  # held by no other node
    assert recoverability.parts_of(1) == [("a", 4, (2,)), ("b", 3, (0,))]  # each job's newest step, recoverable or not
    assert recoverability.parts_of(0) == [("b", 3, (1,)), ("c", 5, (1,))]  # job a's step 4: node 0's part is not held
    assert recoverability.parts_of(2) == []
