"""A storage root that someone else has written into (issue 20, findings 2 and 3), with real
daemons over their sockets: nothing planted in a job's recycle bin is followed, opened or
removed, another job's committed step stays byte-identical, and under the systemd unit's umask
(UMask=0007) every directory the daemon makes is 0750 and every file 0640."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import torch

from ckptd.client import CheckpointClient


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(step_dir: Path) -> dict[str, str]:
    """sha256 of every file of a step directory (links are not followed: none is expected)."""
    return {p.name: sha256(p) for p in sorted(step_dir.iterdir()) if p.is_file() and not p.is_symlink()}


def states(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    a = {"model": {"w": torch.randn(64 * 1024, generator=g)}, "extra": {"job": "a"}}
    b = {"model": {"w": torch.randn(256 * 1024, generator=g)}, "extra": {"job": "b"}}
    return a, b


def loads_as_saved(client: CheckpointClient, state: dict, step: int) -> None:
    restored = {"model": {"w": torch.zeros_like(state["model"]["w"])}, "extra": {}}
    assert client.load(restored) == step
    assert torch.equal(restored["model"]["w"], state["model"]["w"]) and restored["extra"] == state["extra"]


def test_a_link_a_hard_link_and_a_fifo_in_the_recycle_bin_are_left_alone(daemons) -> None:
    daemon = daemons.start("--keep-last", "1")
    a_state, b_state = states(0)
    with CheckpointClient("job-a", address=daemon.address, on_error="raise") as a, CheckpointClient("job-b", address=daemon.address, on_error="raise") as b:
        b.save(1, b_state).wait_durable(timeout=60)
        b.save(2, b_state).wait_durable(timeout=60)  # retention keeps 2: step 1's data file goes to b's recycle bin
        a.save(1, a_state).wait_durable(timeout=60)
        bin_dir = daemon.root / "job-b" / ".recycle"
        recycled = sorted(bin_dir.iterdir())
        assert len(recycled) == 1, recycled
        a_step = daemon.root / "job-a" / "step-00000001"
        (shard,) = sorted(a_step.glob("*.safetensors"))
        before = digests(a_step)

        recycled[0].unlink()
        recycled[0].symlink_to(shard)  # b's recycled file, replaced by a link to a's committed shard
        os.link(shard, bin_dir / "hard")  # a's shard itself, a second name (st_nlink 2)
        os.mkfifo(bin_dir / "fifo")
        with torch.no_grad():
            b_state["model"]["w"] += 1
        b.save(3, b_state).wait_durable(timeout=60)  # succeeds, with new files

        assert digests(a_step) == before
        assert os.readlink(recycled[0]) == str(shard)
        assert os.lstat(bin_dir / "hard").st_ino == os.lstat(shard).st_ino and os.lstat(shard).st_nlink == 2
        assert stat.S_ISFIFO(os.lstat(bin_dir / "fifo").st_mode)
        b_step = daemon.root / "job-b" / "step-00000003"
        assert not any(p.is_symlink() for p in b_step.iterdir())
        assert all(os.lstat(p).st_nlink == 1 for p in b_step.iterdir())
        loads_as_saved(a, a_state, 1)
        loads_as_saved(b, b_state, 3)
    log = daemon.log_text()
    for name in (recycled[0].name, "hard", "fifo"):
        assert f"leaving {bin_dir / name} in the recycle bin alone" in log, (name, log[-3000:])


def test_a_recycle_bin_that_is_a_link_to_another_jobs_step_is_not_used(daemons) -> None:
    daemon = daemons.start("--keep-last", "1")
    a_state, b_state = states(1)
    with CheckpointClient("job-a", address=daemon.address, on_error="raise") as a, CheckpointClient("job-b", address=daemon.address, on_error="raise") as b:
        a.save(1, a_state).wait_durable(timeout=60)
        b.save(1, b_state).wait_durable(timeout=60)
        a_step = daemon.root / "job-a" / "step-00000001"
        before = digests(a_step)
        bin_dir = daemon.root / "job-b" / ".recycle"
        if bin_dir.exists():
            for p in bin_dir.iterdir():
                p.unlink()
            bin_dir.rmdir()
        bin_dir.symlink_to(a_step)  # a's committed step as b's recycle bin
        for step in (2, 3):  # each retention pass would have emptied the bin into it
            b.save(step, b_state).wait_durable(timeout=60)

        assert digests(a_step) == before and bin_dir.is_symlink() and os.readlink(bin_dir) == str(a_step)
        loads_as_saved(a, a_state, 1)
        loads_as_saved(b, b_state, 3)
    assert f"{bin_dir} is a symbolic link" in daemon.log_text()


def test_every_directory_is_0750_and_every_file_0640_under_the_units_umask(daemons) -> None:
    daemons.root.mkdir(parents=True)
    os.chmod(daemons.root, 0o750)  # the unit's StateDirectoryMode=0750
    old = os.umask(0o007)  # the unit's UMask=0007, inherited by the daemon
    try:
        daemon = daemons.start("--keep-last", "1")
    finally:
        os.umask(old)
    a_state, _ = states(2)
    with CheckpointClient("job-a", address=daemon.address, on_error="raise") as a:
        a.save(1, a_state).wait_durable(timeout=60)
        a.save(2, a_state).wait_durable(timeout=60)  # step 1 removed: the recycle bin made
    job_dir = daemon.root / "job-a"
    assert {"latest", ".recycle", "step-00000002"} <= {p.name for p in job_dir.iterdir()}
    assert {"ckptd.index.json", "extra.json"} <= {p.name for p in (job_dir / "step-00000002").iterdir()}
    modes = {}
    for dirpath, _dirnames, filenames in os.walk(daemon.root):
        modes[dirpath] = stat.S_IMODE(os.lstat(dirpath).st_mode)
        for name in filenames:
            modes[os.path.join(dirpath, name)] = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
    wrong = {path: oct(mode) for path, mode in modes.items() if mode != (0o750 if os.path.isdir(path) else 0o640)}
    assert not wrong, wrong
    assert len(modes) >= 8
