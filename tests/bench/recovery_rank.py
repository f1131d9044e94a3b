"""One rank of tests/bench/bench_recovery.py, started by torchrun: `recovery_rank.py SPEC_JSON`.

The state: `tensors` fp32 tensors, row-sharded over the world (LocalShard), `node_mib` MiB per
node. A rank's shard of tensor i at step s is base(i, rank) + s, where base holds multiples of
1/256 below 8 in magnitude, so adding 1.0 per step is exact and the value of any step can be
made again to compare bit for bit.

Modes (spec["mode"]):
- "train": from step 1, each step adds 1.0 to every tensor and all-reduces a scalar (gloo); every
  `every` steps, `saves` times, saves with the real client and waits until durable; then goes
  on training (a step per 0.1 s) until a peer is lost: the failing collective is logged as
  "lost" and the rank exits 1.
- "resume": loads the newest step (the client's "planned in / filled in" timing line is
  recorded), trains one step, checks the restored state bit-exact, then saves the step it
  trained and waits until it is durable.

Every event is one JSON line {"event": ..., "time": epoch seconds, ...} in OUT/rank<R>.jsonl.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: the process's start, as far as this script can tell

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TextIO  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ckptd.client import CheckpointClient  # noqa: E402
from ckptd.client.shards import LocalShard  # noqa: E402


def shape(tensors: int, node_mib: int, nodes: int, world: int) -> tuple[int, int]:
    """(rows, cols) of every tensor: `nodes` * node_mib MiB in all, rows divisible by `world`."""
    elements = nodes * node_mib * 2**20 // 4 // tensors
    cols = 256
    rows = max(world, elements // cols // world * world)
    return rows, cols


def base(index: int, rank: int, rows: int, cols: int) -> torch.Tensor:
    """The rank's shard of tensor `index` at step 0: multiples of 1/256 in (-8, 8)."""
    g = torch.Generator().manual_seed(index * 100_003 + rank)
    return torch.randn(rows, cols, generator=g).clamp_(-7.9, 7.9).mul_(256).round_().div_(256)


class Events:
    """The rank's JSON lines; also takes the client's load timing (a logging handler)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def write(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        self.out.flush()


class LoadTiming(logging.Handler):
    """The client's "step N loaded: planned in P s, filled in F s" record, as an event."""

    def __init__(self, events: Events) -> None:
        super().__init__(logging.DEBUG)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "plan_s"):
            self.events.write("client_load", plan_s=record.__dict__["plan_s"], fill_s=record.__dict__["fill_s"])


def main(spec: dict[str, Any]) -> int:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    events = Events(open(out / f"rank{rank}.jsonl", "a"))
    events.write("started", process_start=STARTED, node=int(os.environ["GROUP_RANK"]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    events.write("group")
    rows, cols = shape(spec["tensors"], spec["node_mib"], spec["nodes"], world)
    part = rows // world
    ckpt = CheckpointClient(spec["job"], on_error="raise", timeout_s=600)
    one = torch.ones(1)
    if spec["mode"] == "train":
        tensors = [base(i, rank, part, cols) for i in range(spec["tensors"])]
        state = {"model": {f"t{i:04d}": LocalShard(t, (rank * part, 0), (rows, cols)) for i, t in enumerate(tensors)}}
        step, saved = 0, 0
        while True:
            step += 1
            for t in tensors:
                t.add_(1.0)
            try:
                dist.all_reduce(one)
            except RuntimeError as exc:  # a peer is gone: the group cannot go on
                events.write("lost", step=step, error=str(exc)[:300])
                return 1
            if saved < spec["saves"] and step % spec["every"] == 0:
                ckpt.save(step, state).wait_durable(timeout=600)
                saved += 1
                events.write("durable", step=step)
            elif saved >= spec["saves"]:
                time.sleep(0.1)
    logging.getLogger("ckptd.client").setLevel(logging.DEBUG)
    logging.getLogger("ckptd.client").addHandler(LoadTiming(events))
    tensors = [torch.empty(part, cols) for _ in range(spec["tensors"])]
    state = {"model": {f"t{i:04d}": LocalShard(t, (rank * part, 0), (rows, cols)) for i, t in enumerate(tensors)}}
    events.write("load_begin")
    step = ckpt.load(state)
    events.write("loaded", step=step)
    for t in tensors:
        t.add_(1.0)
    dist.all_reduce(one)
    events.write("first_step", step=(step or 0) + 1)
    wrong = [i for i, t in enumerate(tensors) if step is None or not torch.equal(t, base(i, rank, part, cols).add_(step + 1))]
    events.write("checked", exact=not wrong, wrong=wrong[:10], bytes=sum(t.numel() * 4 for t in tensors))
    if step is not None:  # the job goes on: its next checkpoint, the replacement node's part included
        ckpt.save(step + 1, state).wait_durable(timeout=600)
        events.write("saved_again", step=step + 1)
    ckpt.close()
    dist.destroy_process_group()
    return 0 if not wrong else 3


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
