"""Worker scripts of the integration tests (a training loop in a file beside its test): loaded
as a module, to train in the test's process, or run as a process that may be SIGKILLed; rank
scripts (tests/integration/gloo_rank.py) run as the processes of one gloo group."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from daemon_rig import free_port


def load_worker(path: Path) -> ModuleType:
    """A worker script beside the tests, as a module: the model, data and loop it trains with."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_worker(path: Path, spec: dict[str, Any], killed: bool = False) -> dict[str, Any]:
    """Run the worker script with `spec` (JSON) to its end, or to its SIGKILL when `killed`;
    returns what it wrote to spec["out"]."""
    proc = subprocess.run([sys.executable, str(path), json.dumps(spec)], capture_output=True, text=True, timeout=240)
    expected = -9 if killed else 0
    assert proc.returncode == expected, f"worker exited with {proc.returncode}, expected {expected}:\n{proc.stderr[-4000:]}"
    return json.loads(Path(spec["out"]).read_text())


def start_ranks(script: Path, world: int, **spec: Any) -> list[subprocess.Popen[bytes]]:
    """Start `world` processes of rank script `script`, one gloo group on a free port of
    127.0.0.1, each with `spec` plus its rank, world_size and the port (JSON in argv[1])."""
    port = free_port()
    return [
        subprocess.Popen([sys.executable, str(script), json.dumps({**spec, "rank": rank, "world_size": world, "port": port})])
        for rank in range(world)
    ]


def run_ranks(script: Path, world: int, timeout_s: float = 180, expect: int = 0, **spec: Any) -> None:
    """Run `world` processes of rank script `script` (start_ranks) and wait for all; fails
    unless every one exits with `expect` (-9: SIGKILLed)."""
    procs = start_ranks(script, world, **spec)
    codes = [p.wait(timeout_s) for p in procs]
    assert codes == [expect] * world, codes


def run_ranks_until_killed(script: Path, world: int, victim: int, timeout_s: float = 180, **spec: Any) -> None:
    """Run `world` ranks of `script` (start_ranks) until rank `victim` SIGKILLs itself, then
    SIGKILL the others, as torchrun's agent stops a group one of whose ranks died; fails unless
    the victim died of SIGKILL and no rank finished (the kill came mid-run). The others may have
    ended on their own meanwhile (gloo fails a collective with a dead peer)."""
    procs = start_ranks(script, world, **spec)
    try:
        procs[victim].wait(timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    assert codes[victim] == -9 and 0 not in codes, codes


def run_torchrun_like(script: Path, spec: dict[str, Any], world_size: int, killed: bool = False) -> dict[str, Any]:
    """The worker script as `world_size` ranks of one gloo job, torch.distributed from the
    environment as torchrun sets it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), `spec` as
    JSON in argv[1]; fails unless every rank exits 0 (-9 when `killed`); returns what it wrote to spec["out"]."""
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, str(script), json.dumps(spec)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(world_size)]
    errors = [proc.communicate(timeout=300)[1] for proc in procs]
    expected = -9 if killed else 0
    for rank, (proc, err) in enumerate(zip(procs, errors)):
        assert proc.returncode == expected, f"rank {rank} exited with {proc.returncode}, expected {expected}:\n{err[-4000:]}"
    return json.loads(Path(spec["out"]).read_text())
