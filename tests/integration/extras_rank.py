"""One rank of a gloo job that saves or loads per-rank extras: `python extras_rank.py SPEC_JSON`
(tests/integration/test_extras_per_rank.py).

Spec: address, job, step, mode ("save" | "load"), out (a directory: rank r writes r.json with
what it loaded), rank, world_size, port. Every rank's state holds a replicated model, a tensor
and a JSON value of its own under "extra", and a stateful object (a data sampler) whose
state_dict holds a tensor of its own; a save makes them functions of the rank, a load starts from
zeros and reports what came back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gloo_rank import run_rank  # beside this script


class Sampler:
    """A data sampler's position: different on every rank."""

    def __init__(self, position: int) -> None:
        self.position = torch.tensor([position, 0])

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "epoch": int(self.position[1])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def state_of(rank: int, saving: bool) -> dict[str, Any]:
    torch.manual_seed(0)  # the same model on every rank: a DDP replica
    model = nn.Linear(4, 4)
    if saving:
        return {"model": model, "extra": {"t": torch.full((4,), rank + 1.0), "r": rank}, "sampler": Sampler(100 + rank)}
    return {"model": model, "extra": {"t": torch.zeros(4), "r": -1}, "sampler": Sampler(-1)}


def run(spec: dict) -> None:
    from ckptd.client import CheckpointClient

    rank = spec["rank"]
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60) as ckpt:
        state = state_of(rank, spec["mode"] == "save")
        if spec["mode"] == "save":
            info = ckpt.save(spec["step"], state).wait_durable(timeout=60)
            result: dict[str, Any] = {"step": info.step if info else None}
        else:
            result = {"step": ckpt.load(state, step=spec["step"])}
        result.update(t=state["extra"]["t"].tolist(), r=state["extra"]["r"], position=state["sampler"].position.tolist())
    Path(spec["out"], f"{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_rank(run)
