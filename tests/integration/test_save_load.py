"""Save and load through a real daemon over its Unix socket: bit-exact round trips, tiers, resume."""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ckptd.client import CheckpointClient, CheckpointError, CheckpointNotFound, LocalShard
from ckptd.format.index import INDEX_NAME
from ckptd.demo.process import DaemonProcess


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


class Net(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seen += tokens.numel()
        return self.head(self.norm(self.body(self.embed(tokens))))


def make_training(seed: int, tied: bool = False) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = Net(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train_step(model: Net, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 50, (4, 12), generator=g)
    logits = model(tokens[:, :-1])  # dropout draws from the global RNG: restored with rng=True
    loss = nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def state_of(model: Net, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, extra: dict) -> dict:
    return {"model": model, "optimizer": opt, "scheduler": sched, "extra": extra}


def assert_same_training_state(a: tuple, b: tuple) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    for (na, ta), (nb, tb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(ta, tb), na
    sda, sdb = oa.state_dict(), ob.state_dict()
    assert sda["param_groups"] == sdb["param_groups"]
    for pid, st in sda["state"].items():
        for key, value in st.items():
            assert torch.equal(value, sdb["state"][pid][key]), (pid, key)
    assert sa.state_dict() == sb.state_dict()


def test_round_trip_is_bit_exact_from_memory_and_from_disk(daemons) -> None:
    daemon = daemons.start()
    src = make_training(0)
    for step in range(1, 5):
        train_step(*src, step)
    extra = {"epoch": 3, "tokens_seen": 123456789, "note": "hello", "ratio": 0.125, "nested": {"a": [1, 2, 3]}}
    random.seed(5)
    np.random.seed(6)
    with CheckpointClient("rt", address=daemon.address, on_error="raise") as ckpt:
        handle = ckpt.save(4, state_of(*src, extra), rng=True)
        assert handle.ok and handle.stall_s > 0
        info = handle.wait_durable(timeout=60)
        assert info is not None and Path(info.step_dir).name == "step-00000004"
        expected_next = (torch.rand(3), random.random(), np.random.rand())

        for tier in ("memory", "disk"):
            if tier == "disk":
                daemon.stop()
                daemon = daemons.start()
                ckpt = CheckpointClient("rt", address=daemon.address, on_error="raise")
            dst = make_training(1)
            got_extra: dict = {"epoch": 0}
            torch.manual_seed(99)
            random.seed(99)
            step = ckpt.load(state_of(*dst, got_extra), rng=True)
            assert step == 4
            assert_same_training_state(src, dst)
            assert got_extra == extra
            assert (torch.rand(3), random.random(), np.random.rand())[1:] == expected_next[1:]
            infos = ckpt.list()
            assert [i.step for i in infos] == [4] and infos[0].in_memory == (tier == "memory")


def test_resumed_training_follows_the_uninterrupted_run(daemon) -> None:
    total, cut = 10, 4
    reference = make_training(7)  # seeds the global RNG, which dropout draws from
    ref_losses = [train_step(*reference, s) for s in range(1, total + 1)]

    first = make_training(7)
    losses = [train_step(*first, s) for s in range(1, cut + 1)]
    with CheckpointClient("resume", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(cut, state_of(*first, {"step": cut}), rng=True).wait_durable(timeout=60)
        torch.manual_seed(555)  # the restarted process starts from other random state
        second = make_training(8)
        extra: dict = {}
        start = ckpt.load(state_of(*second, extra), rng=True)
    assert start == cut and extra == {"step": cut}
    losses += [train_step(*second, s) for s in range(start + 1, total + 1)]
    assert losses == ref_losses


def test_a_save_before_the_first_optimizer_step_changes_neither_training_nor_a_resume(daemon) -> None:
    """Reading a fresh optimizer's state initializes it (Adam's step becomes 1); ckptd takes that
    state out again and marks the checkpoint, so both the run that saved and one resumed from
    the step-0 checkpoint follow a run that never saved."""
    total = 5
    reference = make_training(7)
    ref_losses = [train_step(*reference, s) for s in range(1, total + 1)]
    with CheckpointClient("fresh", address=daemon.address, on_error="raise") as ckpt:
        saving = make_training(7)
        ckpt.save(0, state_of(*saving, {}), rng=True).wait_durable(timeout=60)
        assert not saving[1].state  # still fresh
        assert [train_step(*saving, s) for s in range(1, total + 1)] == ref_losses
        resumed = make_training(8)
        assert ckpt.load(state_of(*resumed, {}), step=0, rng=True) == 0
        assert not resumed[1].state
        assert [train_step(*resumed, s) for s in range(1, total + 1)] == ref_losses


def test_model_files_load_with_safetensors_and_tied_weights_are_stored_once(daemon) -> None:
    model, opt, sched = make_training(0, tied=True)
    train_step(model, opt, sched, 1)
    with CheckpointClient("tied", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(1, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
        step_dir = Path(info.step_dir)
        weights = load_file(step_dir / "model-00001-of-00001.safetensors")
        assert "embed.weight" in weights and "head.weight" not in weights
        for name, tensor in model.state_dict().items():
            if name != "head.weight":
                assert torch.equal(weights[name], tensor), name
        hf_index = json.loads((step_dir / "model.safetensors.index.json").read_text())
        assert set(hf_index["weight_map"]) == set(weights)
        index = json.loads((step_dir / INDEX_NAME).read_text())
        assert index["tensors"]["model/embed.weight"]["aliases"] == ["model/head.weight"]

        fresh, fresh_opt, _ = make_training(3, tied=True)
        assert ckpt.load({"model": fresh, "optimizer": fresh_opt}) == 1
        assert fresh.head.weight is fresh.embed.weight
        assert torch.equal(fresh.head.weight, model.head.weight)

        untied, _, _ = make_training(3, tied=False)  # a tied checkpoint into an untied model
        assert ckpt.load({"model": untied}) == 1
        assert torch.equal(untied.head.weight, model.embed.weight)


def test_an_untied_step_loads_into_a_tied_model_when_the_two_weights_are_equal_and_is_refused_when_not(daemon) -> None:
    untied, _, _ = make_training(0, tied=False)
    tied, _, _ = make_training(3, tied=True)
    with CheckpointClient("untied-into-tied", address=daemon.address, on_error="raise") as ckpt:
        with torch.no_grad():
            untied.head.weight.copy_(untied.embed.weight)  # saved apart, equal
        ckpt.save(1, {"model": untied}).wait_durable(timeout=60)
        assert ckpt.load({"model": tied}) == 1
        assert tied.head.weight is tied.embed.weight and torch.equal(tied.embed.weight, untied.embed.weight)

        with torch.no_grad():
            untied.head.weight.add_(1.0)  # now different: one tensor cannot take both
        ckpt.save(2, {"model": untied}).wait_durable(timeout=60)
        before = {k: v.clone() for k, v in tied.state_dict().items()}
        with pytest.raises(CheckpointError, match=r"'model/embed.weight' and 'model/head.weight' are one tensor in the state being loaded \(tied\), but step 2 holds different values"):
            ckpt.load({"model": tied})
        assert all(torch.equal(v, before[k]) for k, v in tied.state_dict().items())  # refused before a byte was filled
        assert ckpt.load({"model": tied}, strict=False) == 2
        assert torch.equal(tied.head.weight, untied.embed.weight)  # the name's value, as the message says


def test_strict_load_names_missing_and_unexpected_tensors(daemon) -> None:
    model, opt, sched = make_training(0)
    with CheckpointClient("strict", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model}).wait_durable(timeout=60)
        bigger = nn.Sequential(nn.Linear(3, 3))
        with pytest.raises(CheckpointError, match=r"missing from step 1: model/0\.weight.*not in the state being loaded: model/body"):
            ckpt.load({"model": bigger})
        other, _, _ = make_training(0)
        other.embed = nn.Embedding(51, 16)
        with pytest.raises(CheckpointError, match=r"'model/embed.weight' has shape \[50, 16\]"):
            ckpt.load({"model": other})
        with pytest.raises(CheckpointError, match="step 2 of job 'strict' is not committed"):
            ckpt.load({"model": model}, step=2)
        assert CheckpointClient("nothing-yet", address=daemon.address).load({"model": model}) is None


def test_saving_a_committed_step_again_is_refused_and_the_old_one_kept(daemon) -> None:
    model, _, _ = make_training(0)
    with CheckpointClient("again", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(5, {"model": model}).wait_durable(timeout=60)
        with pytest.raises(CheckpointError, match="already committed"):
            ckpt.save(5, {"model": model})
        assert ckpt.latest() == 5


def test_a_rank_holding_no_bytes_saves_with_the_others_and_the_step_loads(daemon) -> None:
    """Found by an attacker's probe: a rank whose tensors are all empty (FSDP's Shard(0) over more
    ranks than rows) gets no arena, and its save opened the arena path "" (FileNotFoundError),
    failing the step on every rank. It has nothing to copy: the step commits."""
    full = torch.arange(4.0).reshape(1, 4)
    local = {0: LocalShard(full.clone(), (0, 0), (1, 4)), 1: LocalShard(torch.zeros(0, 4), (1, 0), (1, 4))}
    done: dict[int, object] = {}

    def rank(r: int) -> None:
        with CheckpointClient("no-bytes", address=daemon.address, rank=r, world_size=2, on_error="raise", timeout_s=30) as ckpt:
            try:
                done[r] = ckpt.save(1, {"model": {"w": local[r]}}).wait_durable(timeout=60).step
            except CheckpointError as exc:
                done[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert done == {0: 1, 1: 1}, done
    with CheckpointClient("no-bytes", address=daemon.address, on_error="raise") as ckpt:
        restored = {"model": {"w": torch.zeros(1, 4)}}
        assert ckpt.load(restored) == 1 and torch.equal(restored["model"]["w"], full)
        assert ckpt.save(2, {"model": {"empty": torch.zeros(0, 5)}}).wait_durable(timeout=60).step == 2  # one rank, no bytes at all
        empty = {"model": {"empty": torch.ones(0, 5)}}
        assert ckpt.load(empty) == 2


EXIT_WITHOUT_CLOSE = """
import sys, torch
from ckptd.client import CheckpointClient
model = torch.nn.Linear(4, 4)
client = CheckpointClient(job=sys.argv[2], address=sys.argv[1], on_error="raise")
if sys.argv[3] == "save":
    client.save(1, {"model": model}).wait_durable(timeout=60)
print("loaded", client.load({"model": model}, step=1), flush=True)  # the last call; no close()
"""


def test_a_process_whose_last_call_is_a_load_exits_without_closing_the_client(daemon, tmp_path: Path) -> None:
    """Found by a new user's probe: a script (an evaluation job) whose last ckptd call was load(),
    without close(), hung at exit (the probe: 7 runs of 8; reproduced here in 3 of 6): the load's LoadDone call, left in flight,
    deadlocked grpc's channel as the interpreter tore it down. The client closes at exit."""
    script = tmp_path / "eval.py"
    script.write_text(EXIT_WITHOUT_CLOSE)
    for i in range(3):  # it hung in about half the runs
        out = subprocess.run([sys.executable, str(script), daemon.address, "exit", "save" if i == 0 else "load"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "loaded 1" in out.stdout, (i, out.stdout, out.stderr[-2000:])


FORKED_CHILD_EXITS = """
import os, sys, torch
from ckptd.client import CheckpointClient
client = CheckpointClient(job=sys.argv[2], address=sys.argv[1], on_error="raise")
client.save(1, {"model": torch.nn.Linear(2, 2)}).wait_durable(timeout=60)
child = os.fork()
if child == 0:
    try:
        client.save(2, {"model": torch.nn.Linear(2, 2)})
    except Exception as exc:  # the inherited client refuses to work in the child, at once
        sys.exit(0 if "make a new CheckpointClient in this process" in str(exc) else 3)
    sys.exit(4)  # exits normally: atexit runs, and must leave the parent's client alone
_, status = os.waitpid(child, 0)
print("child", status, "then step", client.save(2, {"model": torch.nn.Linear(2, 2)}).wait_durable(timeout=60).step, flush=True)
"""


def test_a_client_dropped_without_close_is_closed_when_collected(daemon) -> None:
    """Found in review of the close at exit: a save's commit, kept by the hand-off, held the
    client through its callbacks, so a dropped client lived (threads, channel, mappings) until
    the process ended. Nothing the hand-off keeps holds the client."""
    client = CheckpointClient("dropped", address=daemon.address, on_error="raise")
    client.save(1, {"model": nn.Linear(2, 2)}).wait_durable(timeout=60)
    client.load({"model": nn.Linear(2, 2)})
    alive, closer = weakref.ref(client), client._closer
    del client
    gc.collect()
    assert alive() is None and not closer.alive


def test_a_forked_child_that_exits_does_not_close_its_parents_client(daemon, tmp_path: Path) -> None:
    """The client closes itself at exit (above), but not in a process forked from the one that
    made it: the connection, the threads and the arenas are the parent's, which saves on. The
    child's save with it is refused at once (found by a probe: it returned ok=True, nothing was
    written, and wait_durable hung)."""
    script = tmp_path / "fork.py"
    script.write_text(FORKED_CHILD_EXITS)
    out = subprocess.run([sys.executable, str(script), daemon.address, "forked"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and "child 0 then step 2" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_retention_keeps_the_last_three(daemon) -> None:
    model, _, _ = make_training(0)
    with CheckpointClient("keep", address=daemon.address, on_error="raise") as ckpt:
        for step in range(1, 7):
            ckpt.save(step, {"model": model}).wait_durable(timeout=60)
        assert [i.step for i in ckpt.list()] == [4, 5, 6]
    job_dir = daemon.root / "keep"
    # .recycle holds the data files of the last deleted step, to be overwritten by the next save
    assert sorted(p.name for p in job_dir.iterdir()) == [".recycle", "latest", "step-00000004", "step-00000005", "step-00000006"]
    assert (job_dir / "latest").read_text().strip() == "step-00000006"


def test_each_step_keeps_its_own_extras_whether_they_changed_since_the_last_save_or_not(daemon) -> None:
    """The daemon reuses a rank's extras, parsed and encoded, while their text does not change
    (engine/context.ExtrasTexts.parse, plan/files.CompactExtras): steps with the same extras and steps
    with new ones must each write and load back their own."""
    model, _, _ = make_training(0)
    saved = {1: {"epoch": 0, "tags": ["a"]}, 2: {"epoch": 0, "tags": ["a"]}, 3: {"epoch": 5, "tags": ["a", "é"]}, 4: {"epoch": 0, "tags": ["a"]}}
    with CheckpointClient("extras-steps", address=daemon.address, on_error="raise") as ckpt:
        for step, extra in saved.items():
            ckpt.save(step, {"model": model, "extra": dict(extra)}).wait_durable(timeout=60)
        kept = [i.step for i in ckpt.list()]
        assert kept == [2, 3, 4]  # the daemon keeps the last three
        for step in kept:
            extra = saved[step]
            on_disk = json.loads((daemon.root / "extras-steps" / f"step-{step:08d}" / "extra.json").read_text())
            assert on_disk["step"] == step and on_disk["ranks"]["0"]["extra"] == extra
            got: dict = {}
            assert ckpt.load({"model": make_training(1)[0], "extra": got}, step=step) == step
            assert got == extra


def test_a_missing_daemon_does_not_stop_training(tmp_path: Path) -> None:
    model, _, _ = make_training(0)
    ckpt = CheckpointClient("nodaemon", address=f"unix://{tmp_path}/none.sock", timeout_s=2)
    handle = ckpt.save(1, {"model": model})
    assert not handle.ok and "no ckptd answers" in (handle.error or "")
    assert handle.wait_durable() is None
    assert ckpt.failed_saves == 1
    with pytest.raises(CheckpointError, match="no ckptd answers"):
        CheckpointClient("nodaemon", address=f"unix://{tmp_path}/none.sock", on_error="raise", timeout_s=2).save(1, {"model": model})


def test_sigterm_commits_what_was_handed_over(daemons) -> None:
    daemon = daemons.start()
    model, _, _ = make_training(0)
    with CheckpointClient("term", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model})
    assert daemon.stop() == 0
    assert (daemon.root / "term" / "step-00000001" / INDEX_NAME).is_file()
    assert daemons.arenas() == []


def test_more_ranks_than_at_save_time_get_the_state_but_not_another_ranks_rng(daemon) -> None:
    model, opt, sched = make_training(0)
    train_step(model, opt, sched, 1)
    with CheckpointClient("grow", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        ckpt.save(1, state_of(model, opt, sched, {"epoch": 1}), rng=True).wait_durable(timeout=60)
    for rank in range(2):
        dst = make_training(rank + 5)
        extra: dict = {}
        with CheckpointClient("grow", address=daemon.address, rank=rank, world_size=2, on_error="raise") as ckpt:
            assert ckpt.load(state_of(*dst, extra), rng=True) == 1
        assert_same_training_state((model, opt, sched), dst)
        assert extra == {"epoch": 1}


@pytest.mark.parametrize("read_files", [False, None])
def test_a_trainer_that_cannot_read_the_root_loads_through_the_daemon(daemons, read_files, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_files=False, and None when the files cannot be opened here (a container without the
    storage volume): the daemon copies the bytes into shared memory, the rank reads them from
    there and checks their checksums as for a file; the copies go once the load is done."""
    from ckptd.client import client as client_module

    daemon = daemons.start()
    saved = make_training(3)
    train_step(*saved, 1)
    with CheckpointClient("staged", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, state_of(*saved, {"k": 1})).wait_durable(timeout=60)
    daemon.stop()  # a new daemon: nothing in memory, every byte from disk
    daemon = daemons.start()
    if read_files is None:
        real_access = client_module.os.access
        root = str(daemons.root)
        monkeypatch.setattr(client_module.os, "access", lambda path, mode: not str(path).startswith(root) and real_access(path, mode))
    read_from: list[str] = []
    real_fill = client_module.fill_plan

    def fill(plan, *args):
        read_from.extend(piece.path for piece in plan.pieces)
        return real_fill(plan, *args)

    monkeypatch.setattr(client_module, "fill_plan", fill)
    restored, extra = make_training(4), {}
    with CheckpointClient("staged", address=daemon.address, on_error="raise", read_files=read_files) as ckpt:
        assert ckpt.load(state_of(*restored, extra)) == 1
    assert_same_training_state(saved, restored)
    assert extra == {"k": 1}
    assert read_from and all(path.startswith(str(daemons.shm_dir)) for path in read_from), read_from
    assert not list(daemons.shm_dir.glob("*-fetch-*"))


def test_a_load_that_finds_no_checkpoint_leaves_a_fresh_optimizer_fresh(daemon) -> None:
    """`start = ckpt.load(state) or 0` on a new job must not change the training that follows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with CheckpointClient("fresh-load", address=daemon.address, on_error="raise") as ckpt:
        assert ckpt.load({"model": model, "optimizer": opt}) is None
        assert not opt.state
        with pytest.raises(CheckpointNotFound):
            ckpt.load({"model": model, "optimizer": opt}, step=3)
        assert not opt.state


class _TwoHeads(torch.nn.Module):
    """A model whose second head gets no gradient before step 3 (Adam holds no state for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.late = torch.nn.Linear(4, 4)


def _two_heads_step(model: _TwoHeads, optimizer: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
    x = torch.arange(8.0).reshape(2, 4) * step
    out = model.used(x) if step < 3 else model.late(model.used(x))
    optimizer.zero_grad()
    out.square().mean().backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strict", [True, "missing"])
def test_a_parameter_without_optimizer_state_yet_resumes_under_a_strict_load(daemon, strict) -> None:
    """Found by a probe: a parameter not stepped yet (an unused branch, a head trained later)
    has no Adam state; a strict load into the restarted program's fresh optimizer, which the load
    initializes for every parameter, was refused as missing that state. It now resumes as the
    uninterrupted run, the late head's state starting at its first gradient, and loads into the
    saving process's own optimizer too; a tensor truly missing is still refused."""
    torch.manual_seed(0)
    model = _TwoHeads()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in (1, 2):
        _two_heads_step(model, optimizer, step)
    with CheckpointClient(f"late-head-{strict}", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(2, {"model": model, "optimizer": optimizer}).wait_durable(timeout=60)
        saved_avg = optimizer.state[model.used.weight]["exp_avg"].clone()
        expected = [_two_heads_step(model, optimizer, step) for step in (3, 4)]
        torch.manual_seed(1)
        resumed = _TwoHeads()
        fresh = torch.optim.Adam(resumed.parameters(), lr=0.01)
        assert ckpt.load({"model": resumed, "optimizer": fresh}, strict=strict) == 2
        assert set(fresh.state) == set(resumed.used.parameters())
        got = [_two_heads_step(resumed, fresh, step) for step in (3, 4)]
        assert all(torch.equal(a, b) for a, b in zip(sum(expected, []), sum(got, []))), "the resumed run differs"
        again = _TwoHeads()
        stepped = torch.optim.Adam(again.parameters(), lr=0.01)
        _two_heads_step(again, stepped, 1)  # state for `used` only, as at the save
        assert ckpt.load({"model": again, "optimizer": stepped}, step=2, strict=strict) == 2
        assert torch.equal(stepped.state[again.used.weight]["exp_avg"], saved_avg)
        other = _TwoHeads()
        with pytest.raises(CheckpointError, match=r"missing from step 2: extra/"):
            ckpt.load({"model": other, "optimizer": torch.optim.Adam(other.parameters()), "extra": {"t": torch.zeros(1)}}, step=2, strict=strict)
