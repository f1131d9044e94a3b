"""`torchrun` (python -m torch.distributed.run) of real worker scripts for the integration tests:
one node, gloo on CPU, the ranks' daemon at $CKPTD_ADDRESS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable


def torchrun(
    worker: Path, address: str, spec: dict[str, Any], *, log: Path, nproc: int = 2, max_restarts: int = 0, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """Start `python -m torch.distributed.run --standalone` of `nproc` ranks of `worker SPEC_JSON`
    in a session of its own (output to `log`); spec["out"] is created."""
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the restarted ranks' store is rank 0's, new at each
    # attempt; with the agent's store shared across attempts, a restarted rank may read the dead
    # rank 0's gloo address of the first attempt (pytorch/pytorch#135712) and fail to connect
    # TMPDIR: the elastic agent's torchelastic_* directories (never removed when a rank is killed)
    # go under the test's own directory rather than accumulate in /tmp
    scratch = log.parent / f"{log.stem}.tmp"
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "CKPTD_ADDRESS": address, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TMPDIR": str(scratch)}
    env.pop("CKPTD_RUN_ID", None)  # the run id is torchrun's (run id, restart count, rendezvous)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", *extra, str(worker), json.dumps(spec),
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(run: subprocess.Popen[bytes], log: Path, timeout: float = 240, ok: bool = True, daemon_log: Callable[[], str] | None = None) -> str:
    """Wait for a torchrun; its output. ok: fail the test unless it exited 0, with the end of
    its output and of `daemon_log()` (the daemon's log: why it answered what it did)."""
    try:
        run.wait(timeout)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)  # torchrun and its workers (their own session)
            run.wait()
    output = log.read_text(errors="replace")
    if ok:
        assert run.returncode == 0, output[-4000:] + ("\n--- the daemon's log ends:\n" + daemon_log()[-4000:] if daemon_log else "")
    return output
