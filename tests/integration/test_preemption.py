"""Preemption with real signals (issue 31 item 6; docs/usage.md "Restarts and preemption").

- SIGTERM to torchrun's agent mid-training, as Kubernetes sends it to the container's main
  process: the agent forwards it to both DDP ranks (restart_rank.py, `Preemption`), they agree on
  the step at the next boundary, save it, wait until durable and exit 143; the step is committed
  and loads bit for bit as the ranks held it.
- The grace period: a rank told to stop while its daemon is stopped (SIGSTOP) exits after the
  grace period with status 1, saying which step is not durable and why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from ckptd.client import CheckpointClient
from daemon_rig import DaemonFactory, free_port
from torchrun_rig import finish, torchrun

WORKER = Path(__file__).with_name("restart_rank.py")


def wait_for_steps(out: Path, rank: int, steps: int, timeout: float = 120) -> None:
    """Until the rank's log holds `steps` trained steps."""
    path = out / f"rank{rank}.jsonl"
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= steps):
        assert time.monotonic() < deadline, f"rank {rank} did not train {steps} steps in {timeout} s"
        time.sleep(0.1)


def restart_rank():
    """The worker's module (its model and state helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("restart_rank", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# issue 31 item 6
def test_sigterm_to_torchrun_saves_the_step_durably_and_exits(daemons: DaemonFactory, tmp_path: Path) -> None:
    daemon = daemons.start()
    out = tmp_path / "out"
    spec = {"job": "preempted", "steps": 10_000, "out": str(out), "preempt": {"grace_s": 25, "step_sleep": 0.05}}
    # a restart spare: an attempt can die at start-up for a reason outside ckptd (rank 0's store
    # port, picked free by torchrun, taken before it binds); a SIGTERM stops the agent regardless
    run = torchrun(WORKER, daemon.address, spec, log=tmp_path / "torchrun.log", max_restarts=1, extra=("--shutdown-timeout", "30"))
    wait_for_steps(out, 0, 3)
    run.send_signal(signal.SIGTERM)  # the agent only, as a container runtime signals PID 1
    output = finish(run, tmp_path / "torchrun.log", ok=False)
    assert run.returncode != 0  # the agent was told to stop
    durable = [line for line in output.splitlines() if "ckptd: preempted (SIGTERM): step" in line and "is durable" in line]
    assert len(durable) == 2, output[-4000:]  # both ranks
    steps = {int(line.split(": step ")[1].split()[0]) for line in durable}
    assert len(steps) == 1, durable  # the ranks agreed on the step
    step = steps.pop()

    worker = restart_rank()
    model = worker.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    with CheckpointClient("preempted", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.latest() == step
        assert ckpt.load({"model": model, "optimizer": optimizer}) == step
    got = worker.flat_state(model, optimizer)
    for rank in (0, 1):
        held = load_file(str(out / f"state{rank}.safetensors"))
        assert held.keys() == got.keys()
        for name, value in held.items():
            assert torch.equal(got[name], value), (rank, name)


# issue 31 item 6
def test_sigterm_with_the_daemon_stopped_exits_after_the_grace_period(daemons: DaemonFactory, tmp_path: Path) -> None:
    daemon = daemons.start()
    out = tmp_path / "out"
    out.mkdir()
    spec = {"job": "stalled", "steps": 10_000, "out": str(out), "preempt": {"grace_s": 3, "step_sleep": 0.05}}
    env = {
        **os.environ, "CKPTD_ADDRESS": daemon.address, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0",
    }
    rank = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(out, 0, 2)
        os.kill(daemon.pid, signal.SIGSTOP)
        signalled = time.monotonic()
        rank.send_signal(signal.SIGTERM)
        output, _ = rank.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert rank.returncode == 1, output[-4000:]
    assert 2.5 < took < 10, took  # the grace period (3 s), plus a step and the exit
    assert "ckptd: preempted (SIGTERM): step" in output and "is NOT durable: not durable within the 3 s grace period" in output, output[-4000:]
    assert "is the daemon at" in output
