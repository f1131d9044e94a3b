"""The set-up every rank script of the integration tests shares: a gloo group on 127.0.0.1."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


def run_rank(body: Callable[[dict], None]) -> None:
    """Parse the spec (JSON in argv[1]: rank, world_size, port, ...), join the group, run `body(spec)`."""
    spec = json.loads(sys.argv[1])
    # a native abort (gloo, gRPC) prints every thread's Python stack: where it happened, not just "terminate called"
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=spec["rank"], world_size=spec["world_size"], timeout=timedelta(seconds=60))
    try:
        body(spec)
        # every rank done before any tears its connections down: gloo aborts a process whose
        # peer closed a pair it still had a pending operation on
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The rank's work is done and its results are written. Interpreter finalization is skipped:
    # native threads (gloo, gRPC) racing the teardown aborted a finished rank once in CI
    # ("terminate called without an active exception", exit -6) and failed a passing test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
