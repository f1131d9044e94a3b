"""LoadLeases (engine/load_leases.py): the leases of loads in progress, by load id, by client,
by step, and past their time."""

from __future__ import annotations

from ckptd.daemon.engine.load_leases import LoadLeases


def test_a_lease_is_found_by_its_step_and_ended_once() -> None:
    leases = LoadLeases()
    load_id = leases.add("j", 3, None, "c1")
    assert len(leases) == 1 and leases.steps("j") == {3} and leases.reading("j", 3)
    assert not leases.reading("j", 4) and leases.steps("other") == set()
    lease = leases.pop(load_id)
    assert lease is not None and (lease.job, lease.step, lease.client) == ("j", 3, "c1")
    assert leases.pop(load_id) is None and len(leases) == 0 and not leases.reading("j", 3)


def test_a_clients_leases_are_its_own_in_its_own_job_and_an_unnamed_client_has_none() -> None:
    leases = LoadLeases()
    mine = {leases.add("j", 1, None, "c1"), leases.add("j", 2, None, "c1")}
    leases.add("j", 1, None, "c2")
    leases.add("other", 1, None, "c1")  # the same id in another job: another client
    old = leases.add("j", 1, None, "")  # a client older than client ids
    assert set(leases.of_client("j", "c1")) == mine
    assert leases.of_client("j", "") == [] and old not in leases.of_client("j", "c2")


def test_only_leases_past_their_time_expire() -> None:
    assert LoadLeases().expired() == []
    short = LoadLeases(lease_s=-1.0)
    load_id = short.add("j", 1, None, "c1")
    assert short.expired() == [load_id]
    long = LoadLeases()
    long.add("j", 1, None, "c1")
    assert long.expired() == []


class _Held:
    """A Snapshot's lease and release, counted."""

    def __init__(self) -> None:
        self.readers = 0

    def lease(self) -> None:
        self.readers += 1

    def release(self) -> None:
        self.readers -= 1


def test_the_snapshot_a_load_reads_is_leased_with_it_and_released_once_when_it_ends() -> None:
    leases, held = LoadLeases(), _Held()
    load_id = leases.add("j", 1, held, "c1")  # type: ignore[arg-type]
    assert held.readers == 1
    assert leases.pop(load_id) is not None and held.readers == 0
    assert leases.pop(load_id) is None and held.readers == 0
