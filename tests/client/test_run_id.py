"""Where a client's run id comes from (client/ckptd/client/run_id.py; issue 30, finding 6): the
caller's, a new one for a job of one rank, rank 0's through torch.distributed (several processes:
tests/integration/test_job_identity.py), the launcher's, else this host and parent process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptd.client import CheckpointClient
from ckptd.client.run_id import RUN_ID_ENV, RunIdentity, _broadcast_from_rank0, _distributed_matches, launcher_run_id, process_run_id
from ckptd.common.names import InvalidNameError

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_the_callers_id_comes_first() -> None:
    assert RunIdentity(0, 4, "job-7.attempt-2", env={}).get() == "job-7.attempt-2"
    identity = RunIdentity(3, 4, None, env={RUN_ID_ENV: "from-env", "SLURM_JOB_ID": "9"})
    assert identity.get() == "from-env" and identity.source == f"${RUN_ID_ENV}"
    with pytest.raises(InvalidNameError, match="invalid run id '../x'.*the same on every rank"):
        RunIdentity(0, 1, "../x", env={})
    with pytest.raises(InvalidNameError, match="invalid run id"):
        CheckpointClient("j", address="unix:///nonexistent.sock", rank=0, world_size=1, run_id="a b")


def test_a_job_of_one_rank_gets_its_process_id_the_same_for_every_client() -> None:
    """Review of issue 30: ids were random per client, so a second client of the same job in the
    same process (DCP makes a storage writer per save) was refused as another live run."""
    first, second = RunIdentity(0, 1, None, env={}), RunIdentity(0, 1, None, env={})
    assert HEX32.fullmatch(first.get()) and first.get() == second.get() == process_run_id() and first.source == "process"
    assert first.get() == first.get()  # settled once


def test_another_process_has_another_id() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_run_id(child.pid) != process_run_id() and HEX32.fullmatch(process_run_id(child.pid))
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("env", "same_as", "differs_from"),
    [
        ({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
         {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "3"},
         {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}),  # a restart is a new run
        ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}, {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5"},
         {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"}),
    ],
)
def test_the_launchers_variables_give_every_rank_of_a_start_one_id(env: dict[str, str], same_as: dict[str, str], differs_from: dict[str, str]) -> None:
    ids = [RunIdentity(r, 4, None, env=e) for r, e in ((0, env), (3, same_as), (0, differs_from))]
    assert ids[0].get() == ids[1].get() != ids[2].get() and HEX32.fullmatch(ids[0].get()) and ids[0].source == "launcher"


def test_torchruns_static_rendezvous_id_says_nothing() -> None:
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "29500"}) is None
    assert launcher_run_id({}) is None


def test_without_a_launcher_the_ranks_of_one_process_agree() -> None:
    """Ranks as threads of one process (or processes of one parent on this host)."""
    ids = [RunIdentity(r, 4, None, env={}) for r in range(4)]
    assert len({i.get() for i in ids}) == 1 and ids[0].source == "parent process"


def test_torch_distributed_is_used_when_it_is_this_clients_world(tmp_path: os.PathLike[str]) -> None:
    """The broadcast itself, in a group of one (two processes agree: test_job_identity.py)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        assert _distributed_matches(0, 1) and not _distributed_matches(0, 2) and not _distributed_matches(1, 2)
        assert HEX32.fullmatch(_broadcast_from_rank0())
    finally:
        dist.destroy_process_group()
    assert not _distributed_matches(0, 1)
