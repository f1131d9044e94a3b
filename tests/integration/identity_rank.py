"""One rank of a gloo run that saves and loads a job by a script of steps:
`python identity_rank.py SPEC_JSON` (tests/integration/test_job_identity.py starts the runs).

The spec (JSON): address, job, rank, world_size, port, value (what this run's tensor holds),
out (rank r appends one JSON line per step to out + f".{r}"), and ops, each one of:
  {"op": "save", "step": N, "durable": bool}   save {"model": {"w": full(value)}} with on_error="warn"
                                              (and "raise": true for a client with on_error="raise")
  {"op": "load"}                               load the newest step (into another tensor)
  {"op": "signal", "file": PATH}               rank 0 creates PATH
  {"op": "wait", "file": PATH, "rank": R}      rank R (default: every rank) waits until PATH exists
Each line: the op, and for a save: ok, error, kept; for a load: the step and the value loaded;
an exception out of save or load: its type, message and code.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from gloo_rank import run_rank  # beside this script


def run(spec: dict) -> None:
    from ckptd.client import CheckpointClient
    from ckptd.client.errors import CheckpointError

    rank = spec["rank"]
    out = Path(f"{spec['out']}.{rank}")
    tensor = torch.full((64,), float(spec["value"]))
    clients: dict[str, Any] = {}

    def client(on_error: str) -> Any:
        if on_error not in clients:
            clients[on_error] = CheckpointClient(spec["job"], address=spec["address"], on_error=on_error, timeout_s=60)
        return clients[on_error]

    def record(line: dict[str, Any]) -> None:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")

    for op in spec["ops"]:
        line: dict[str, Any] = {"op": op["op"], "step": op.get("step")}
        try:
            if op["op"] == "save":
                handle = client("raise" if op.get("raise") else "warn").save(op["step"], {"model": {"w": tensor}})
                if op.get("durable") and handle.ok:
                    handle.wait_durable(timeout=60)
                line.update(ok=handle.ok, error=handle.error, kept=getattr(handle, "kept", None))  # kept: issue 30 finding 7
            elif op["op"] == "load":
                loaded = torch.zeros_like(tensor)  # the run's own value stays what it saves
                line["step"] = client("warn").load({"model": {"w": loaded}})
                line["value"] = float(loaded[0])
            elif op["op"] == "signal":
                if rank == 0:
                    Path(op["file"]).touch()
            elif op["op"] == "wait" and op.get("rank", rank) == rank:
                deadline = time.monotonic() + 120
                while not Path(op["file"]).exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{op['file']} did not appear")
                    time.sleep(0.02)
        except CheckpointError as exc:
            line.update(raised=type(exc).__name__, error=str(exc), code=exc.code)
        record(line)
    for c in clients.values():
        c.close()


if __name__ == "__main__":
    run_rank(run)
