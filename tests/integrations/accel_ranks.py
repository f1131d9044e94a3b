"""One process of a 2-process Accelerate job (gloo on CPU) that saves or resumes through
ckptd.integrations.accelerate: `python accel_ranks.py SPEC_JSON` (test_accelerate_ranks.py).

Spec: address, job, step, mode ("save" | "load"), out (a directory: process r writes r.json),
rank, world_size, port. Each process registers for checkpointing an object whose state is its
own (a tensor and a count that differ between the processes), as per-rank objects are (a data
sampler's position, a per-rank metric); a save makes them functions of the process index, a
load starts from empty ones and reports what came back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn


class PerRank:
    """A registered object with state of this process's own."""

    def __init__(self, index: int) -> None:
        self.seen = torch.full((3,), float(index))
        self.count = index

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()
        self.count = int(state["count"])


def run(spec: dict[str, Any]) -> None:
    # what torchrun (or `accelerate launch`) sets for each process
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK=str(spec["rank"]), LOCAL_RANK=str(spec["rank"]),
        WORLD_SIZE=str(spec["world_size"]), LOCAL_WORLD_SIZE=str(spec["world_size"]),
    )
    from accelerate import Accelerator

    from ckptd.client import CheckpointClient
    from ckptd.integrations.accelerate import load_state, save_state

    acc = Accelerator(cpu=True)
    assert acc.num_processes == spec["world_size"], acc.num_processes
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    saving = spec["mode"] == "save"
    mine = PerRank(10 + acc.process_index if saving else -1)
    acc.register_for_checkpointing(mine)
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60) as ckpt:
        if saving:
            info = save_state(acc, ckpt, spec["step"]).wait_durable(timeout=60)
            step = info.step if info is not None else None
        else:
            step = load_state(acc, ckpt)
    result = {"step": step, "process": acc.process_index, "seen": mine.seen.tolist(), "count": mine.count}
    Path(spec["out"], f"{spec['rank']}.json").write_text(json.dumps(result))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(json.loads(sys.argv[1]))
