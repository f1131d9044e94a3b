"""Restores from the daemon's memory through cached copy plans (ckptd.client.reader.fill.MemoryCopies,
issue 33 item 5) against a real daemon: a plan is made once and run again while nothing changed,
every change (a tensor reallocated or moved, another dtype or shape, a new arena, an arena
mapped elsewhere) gives a new one, and every load restores bit for bit, in the client that
saved and in a new one."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.reader import fill
from ckptd.demo.process import DaemonProcess

COUNT = 40


@pytest.fixture
def daemon(module_daemons: Any) -> DaemonProcess:
    return module_daemons.running("--keep-last", "10")


@pytest.fixture
def prepared(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many copies each one-call plan planned (one entry per plan made, -1 for none), from
    pieces (MemoryCopies.prepare) or from columns (MemoryCopies.of_columns)."""
    made: list[int] = []
    prepare, of_columns = fill.MemoryCopies.prepare, fill.MemoryCopies.of_columns

    def counted(plan: fill.MemoryCopies | None) -> fill.MemoryCopies | None:
        made.append(-1 if plan is None else len(plan.sizes))
        return plan

    monkeypatch.setattr(fill.MemoryCopies, "prepare", staticmethod(lambda maps, fills: counted(prepare(maps, fills))))
    monkeypatch.setattr(fill.MemoryCopies, "of_columns", staticmethod(lambda maps, targets, columns: counted(of_columns(maps, targets, columns))))
    return made


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"t{i}": torch.randn(3 + i % 5, 7, generator=g) for i in range(COUNT)}}


def _zeroed(state: dict[str, Any]) -> None:
    for t in state["model"].values():
        t.zero_()


def _assert_same(state: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, want in expected["model"].items():
        got = state["model"][name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


@pytest.fixture
def client(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[CheckpointClient]:
    with CheckpointClient(job=request.node.name.replace("_", "-")[:60], address=str(daemon.address), rank=0, world_size=1, on_error="raise") as c:
        yield c


def test_repeated_loads_run_one_plan_and_restore_exactly(client: CheckpointClient, prepared: list[int]) -> None:
    state = _state(1)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    for _ in range(3):
        _zeroed(state)
        assert client.load(state) == 1
        _assert_same(state, expected)
    assert prepared == [COUNT]  # planned once, run three times


def test_a_reallocated_or_moved_tensor_gets_a_new_plan_and_its_new_memory_is_filled(client: CheckpointClient, prepared: list[int]) -> None:
    state = _state(2)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    client.load(state)
    old = state["model"]["t3"]
    state["model"]["t3"] = torch.zeros_like(old)  # a new tensor under the same name
    old.fill_(7.0)
    client.load(state)
    _assert_same(state, expected)
    assert (old == 7.0).all()  # the replaced tensor's memory was not written
    moved = state["model"]["t5"]
    with torch.no_grad():
        moved.set_(torch.zeros(moved.shape))  # the same tensor object, its data elsewhere now
    client.load(state)
    _assert_same(state, expected)
    assert prepared == [COUNT, COUNT, COUNT]


def test_another_dtype_or_shape_is_a_new_plan(client: CheckpointClient, prepared: list[int]) -> None:
    state = _state(3)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    client.load(state)
    state["model"]["t1"] = torch.zeros(expected["model"]["t1"].shape, dtype=torch.float64)
    client.load(state)
    assert state["model"]["t1"].dtype == torch.float64
    assert torch.equal(state["model"]["t1"], expected["model"]["t1"].double())  # converted, exactly
    assert prepared[-1] == -1  # a conversion is not a plain copy: the general path
    state["model"]["t1"] = torch.zeros(expected["model"]["t1"].shape)
    client.load(state)
    _assert_same(state, expected)
    state["model"]["t2"] = torch.zeros(2, 2)
    with pytest.raises(Exception, match="t2"):
        client.load(state)


def test_loads_between_saves_and_of_older_steps_restore_each_step_exactly(client: CheckpointClient, prepared: list[int]) -> None:
    state = _state(4)
    steps = {}
    for step in range(1, 4):
        for t in state["model"].values():
            t.add_(1.0)
        client.save(step, state).wait_durable()
        steps[step] = {"model": {k: v.clone() for k, v in state["model"].items()}}
        _zeroed(state)
        client.load(state)
        _assert_same(state, steps[step])
    for step in (3, 1, 3, 2, 3):  # older steps may come from files: plans of both kinds in turn
        _zeroed(state)
        client.load(state, step=step)
        _assert_same(state, steps[step])
    assert prepared and all(n == COUNT for n in prepared)


def test_a_plan_whose_arena_is_mapped_elsewhere_copies_nothing_and_the_load_still_restores(client: CheckpointClient) -> None:
    state = _state(5)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    client.load(state)
    known = client._load_structures._last.cache["load_plans"]  # type: ignore[union-attr]
    (known_plan,) = known.values()
    moves = known_plan.moves
    held = [memoryview(client._maps.get(path)) for path, _, _ in moves.bases]  # the old mappings stay where they are
    client._maps.close()  # forgotten: the next use maps each arena anew, elsewhere
    _zeroed(state)
    assert not moves.run(client._maps, 2)
    for view in held:
        view.release()
    assert all((t == 0).all() for t in state["model"].values())  # nothing was copied
    client.load(state)
    _assert_same(state, expected)


def test_a_new_client_restores_exactly(client: CheckpointClient, daemon: DaemonProcess) -> None:
    state = _state(6)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    for _ in range(2):
        with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
            other = {"model": {k: torch.full_like(v, 3.0) for k, v in expected["model"].items()}}
            for _ in range(2):
                assert fresh.load(other) == 1
                _assert_same(other, expected)
                _zeroed(other)


class _Counted:
    """The stub's PlanLoad (called, or sent ahead as a future), recording how many tensors each
    request described, and how each went out ("call" or "ahead")."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.counts: list[int] = []
        self.how: list[str] = []

    def __call__(self, request: Any, **kw: Any) -> Any:
        self.counts.append(len(request.tensors))
        self.how.append("call")
        return self.plan(request, **kw)

    def future(self, request: Any, **kw: Any) -> Any:
        self.counts.append(len(request.tensors))
        self.how.append("ahead")
        return self.plan.future(request, **kw)


class _WithoutColumns:
    """The stub's PlanLoad as a daemon that predates columns answers it: the request's
    memory_columns flag ignored (cleared in a copy: the client compares what it sent ahead)."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    @staticmethod
    def _old(request: Any) -> Any:
        old = type(request)()
        old.CopyFrom(request)
        old.memory_columns = False
        return old

    def __call__(self, request: Any, **kw: Any) -> Any:
        return self.plan(self._old(request), **kw)

    def future(self, request: Any, **kw: Any) -> Any:
        return self.plan.future(self._old(request), **kw)


def _described(ckpt: CheckpointClient) -> list[int]:
    """Wrap the client's PlanLoad to record how many tensors each request described."""
    counted = _Counted(ckpt._rpc.stub.PlanLoad)
    ckpt._rpc.stub.PlanLoad = counted
    return counted.counts


def test_a_restarted_trainer_names_its_structure_by_fingerprint_only_once_the_daemon_knows_it(
    client: CheckpointClient, daemon: DaemonProcess
) -> None:
    """Known from the rank's save (the metadata its BeginSave sent under the same fingerprint) or
    from an earlier load: a load names the structure by its fingerprint alone, in this process
    or a new one; another structure is described."""
    state = _state(7)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    first = _described(client)
    client.load(state)
    client.load(state)
    assert first == [0, 0]  # known from the save: named by its fingerprint alone, twice
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        later = _described(fresh)
        other = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
        fresh.load(other)
        _assert_same(other, expected)
        assert later == [0]  # a new process of the rank: named by its fingerprint alone
        other["model"]["t0"] = torch.zeros(2, 3)  # another structure: unknown, described
        with pytest.raises(Exception, match="t0"):
            fresh.load(other)
        assert later == [0, 0, 0, COUNT]  # sent ahead for the last structure (released), then unknown, then described


def test_a_new_clients_first_load_sends_its_plan_load_before_checking_the_structure(client: CheckpointClient, daemon: DaemonProcess) -> None:
    """A restarted trainer's first load names its structure by the fingerprint it will have
    (StructureCache.fingerprint_first) in a PlanLoad sent before the structure's checks, and
    uses the answer; a state that fails the checks raises their error and leaves no load leased."""
    state = _state(11)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        calls = _Counted(fresh._rpc.stub.PlanLoad)
        fresh._rpc.stub.PlanLoad = calls
        other = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
        assert fresh.load(other) == 1
        _assert_same(other, expected)
        assert (calls.how, calls.counts) == (["ahead"], [0])  # sent ahead, named by its fingerprint, used
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        calls = _Counted(fresh._rpc.stub.PlanLoad)
        fresh._rpc.stub.PlanLoad = calls
        bad = {"model": {**{k: torch.zeros_like(v) for k, v in expected["model"].items()}, "bad name\n": torch.zeros(1)}}
        with pytest.raises(ValueError, match="bad name"):
            fresh.load(bad)
        assert calls.how == ["ahead"]  # sent, then released
        fresh._rpc.settle_load_done()
        assert fresh.status().loads_active == 0
        assert all(torch.equal(bad["model"][k], torch.zeros_like(v)) for k, v in expected["model"].items())  # nothing loaded


def test_a_new_client_fills_the_page_tables_of_its_ranks_part_before_its_first_load(client: CheckpointClient, daemon: DaemonProcess) -> None:
    """Made after a save, a client maps the arena of its rank's part of the held step and fills
    its page tables (ckptd.client.arena_warm) before it is asked to load; the load then copies
    through that very mapping, and restores exactly."""
    state = _state(12)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    part = sum(t.numel() * t.element_size() for t in state["model"].values())
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        fresh._warmup.join(30)
        assert part <= fresh._warmup.populated < part + 4096 * COUNT  # the rank's part (slots aligned), no more
        (path,) = fresh._maps._maps
        mapping = fresh._maps._maps[path]
        other = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
        assert fresh.load(other) == 1
        _assert_same(other, expected)
        assert list(fresh._maps._maps) == [path] and fresh._maps._maps[path] is mapping  # copied through the warm mapping
    with CheckpointClient(job="no-such-job", address=str(daemon.address), rank=0, world_size=1, on_error="raise") as other_job:
        other_job._warmup.join(30)
        assert other_job._warmup.populated == 0 and not other_job._maps._maps  # nothing held: nothing mapped


def test_a_large_tensor_takes_the_one_call_copy_in_the_client_that_saved_and_in_a_new_one(
    daemon: DaemonProcess, client: CheckpointClient, prepared: list[int]
) -> None:
    """A piece of SPLIT_BYTES or more goes with the rest in one call: in the client that saved
    (its arenas mapped and copied through) and in a new client, whose plan comes as columns and
    whose fresh mapping is copied through too (its page faults cost less than pread of the
    arena files). Both restore exactly, the new one again from its now warm mapping."""
    state = _state(5)
    state["model"]["big"] = torch.randn((fill.SPLIT_BYTES // 4) * 3)  # 3x SPLIT_BYTES of fp32
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    _zeroed(state)
    assert client.load(state) == 1
    _assert_same(state, expected)
    assert prepared == [COUNT + 1]
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        for _ in range(2):
            _zeroed(state)
            assert fresh.load(state) == 1
            _assert_same(state, expected)
    assert prepared == [COUNT + 1, COUNT + 1]  # the new client's: from columns, run twice


def _plans(ckpt: CheckpointClient) -> list[Any]:
    """Wrap the client's plan_load to record each plan it got."""
    plans: list[Any] = []
    plan_load = ckpt._rpc.plan_load

    def recorded(*args: Any, **kw: Any) -> Any:
        plans.append(plan_load(*args, **kw))
        return plans[-1]

    ckpt._rpc.plan_load = recorded  # type: ignore[method-assign]
    return plans


def test_a_new_client_gets_its_plan_as_columns_and_fills_targets_a_memcpy_cannot_take_from_them(
    client: CheckpointClient, daemon: DaemonProcess
) -> None:
    """Columns, not one message per tensor (issue 33): for a new client of the layout that saved.
    Targets a memcpy cannot take (not contiguous, a 0-dim, an empty one) are filled from the
    same columns by the general fill, exactly."""
    state = _state(8)
    state["model"]["scalar"] = torch.tensor(2.5)
    state["model"]["empty"] = torch.zeros(0, 3)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        plans = _plans(fresh)
        other = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
        assert fresh.load(other) == 1
        _assert_same(other, expected)
        assert plans[0].columns is not None and not plans[0].pieces
        strided = torch.zeros(7, 7).t()  # t4's shape (7, 7), not contiguous: no memcpy
        other["model"]["t4"] = strided
        assert fresh.load(other) == 1
        _assert_same(other, expected)
        assert plans[1].columns is not None and strided.data_ptr() == other["model"]["t4"].data_ptr()
        assert torch.equal(strided, expected["model"]["t4"])  # filled in place, through the general fill:
        (known,) = fresh._load_structures.for_state(fresh._walk.flatten(other, rank=0), None, None).cache["load_plans"].values()
        assert known.moves is None and known.fills is not None  # no memcpy batch for a strided target; fills made from the columns


def test_columns_from_a_daemon_that_sends_pieces_and_a_plan_of_another_layout_still_restore(
    client: CheckpointClient, daemon: DaemonProcess
) -> None:
    """A daemon that predates columns ignores the request's flag and sends pieces: the client
    reads those. A load in another layout (part of each tensor) is sent as pieces too."""
    state = _state(9)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        fresh._rpc.stub.PlanLoad = _WithoutColumns(fresh._rpc.stub.PlanLoad)
        plans = _plans(fresh)
        other = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
        assert fresh.load(other) == 1
        _assert_same(other, expected)
        assert plans[0].columns is None and len(plans[0].pieces) == COUNT


def test_a_load_of_an_unchanged_state_overlaps_its_plan_load_with_the_structure_check_and_releases_one_it_cannot_use(
    client: CheckpointClient,
) -> None:
    """The PlanLoad of the last load's structure goes out before the state's structure is
    checked; its answer is used when the request turns out the same, else released (no load
    is left leased in the daemon), also when the structure check fails."""
    state = _state(10)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    client.save(1, state).wait_durable()
    calls = _Counted(client._rpc.stub.PlanLoad)
    client._rpc.stub.PlanLoad = calls
    client.load(state)
    client.load(state)
    _assert_same(state, expected)
    assert calls.counts == [0, 0]  # first: named by the fingerprint its save sent; second: sent ahead, used
    state["model"]["t0"] = torch.zeros(2, 3)  # another structure: the one sent ahead is released
    with pytest.raises(Exception, match="t0"):
        client.load(state)
    state["model"]["t0"] = expected["model"]["t0"].clone()
    client.load(state)  # the structure of the failed load is the last: nothing is sent ahead
    state["model"]["bad name\n"] = torch.zeros(1)  # the structure check itself fails
    with pytest.raises(ValueError, match="bad name"):
        client.load(state)
    del state["model"]["bad name\n"]
    client._rpc.settle_load_done()
    assert client.status().loads_active == 0
