"""One trainer rank of the chaos suite (tests/chaos_rig.py): `python chaos_rank.py SPEC_JSON`.

The rank's state at step s is a pure function of (job, s, rank) (`expected_state`), so whoever
checks a loaded step needs nothing but its number. Modes (spec["mode"]):

- "train": join the job's gloo group, resume from the newest committed step (rank 0 asks its
  daemon and tells the others), check the resumed state, then save step after step, waiting for
  each to be durable; one JSON line per event is appended (and fsynced) to spec["log"]:
  {"resume": s, "exact": bool}, {"ack": s} for a step acknowledged durable, {"failed": s, "why": ...}.
- "verify": load each step of spec["steps"] and append {"verify": s, "result": "exact" |
  "mismatch: NAMES" | "error: WHY"}.

A rank never raises on a failed save or load (on_error="warn", as production jobs run): the
chaos kills whole jobs and daemons around it, and only what is acknowledged is judged.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn

TRAINABLE = 24  # parameters updated every step
FROZEN = 8  # parameters that never change: their files are linked by incremental saves
EXTRA_NUMEL = 257


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _numel(i: int) -> int:
    return 512 + 1531 * (i % 7)  # 2-13 KiB of fp32: many small tensors, a few larger


def expected_state(job: str, step: int, rank: int) -> dict[str, torch.Tensor]:
    """{state name: tensor} of this rank at `step`: the model (the same on every rank, frozen
    parts the same at every step) and one tensor extra of this rank's own."""
    out: dict[str, torch.Tensor] = {}
    for i in range(FROZEN):
        out[f"frozen_{i}"] = torch.randn(_numel(i), generator=_generator(job, "frozen", i))
    for i in range(TRAINABLE):
        out[f"w_{i}"] = torch.randn(_numel(i + FROZEN), generator=_generator(job, step, i))
    out["extra/rank_tensor"] = torch.randn(EXTRA_NUMEL, generator=_generator(job, step, "rank", rank))
    return out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.params = nn.ParameterDict()
        for i in range(FROZEN):
            self.params[f"frozen_{i}"] = nn.Parameter(torch.zeros(_numel(i)), requires_grad=False)
        for i in range(TRAINABLE):
            self.params[f"w_{i}"] = nn.Parameter(torch.zeros(_numel(i + FROZEN)))


class Rank:
    """A rank's live state: the model and the extras, filled from `expected_state`."""

    def __init__(self, job: str, rank: int) -> None:
        self.job = job
        self.rank = rank
        self.model = Model()
        self.extra: dict[str, Any] = {"rank_tensor": torch.zeros(EXTRA_NUMEL), "step": 0, "rank": rank}
        self.state = {"model": self.model, "extra": self.extra}

    def set_step(self, step: int) -> None:
        want = expected_state(self.job, step, self.rank)
        with torch.no_grad():
            for name, p in self.model.params.items():
                p.copy_(want[name])
        self.extra["rank_tensor"] = want["extra/rank_tensor"].clone()
        self.extra["step"] = step
        self.extra["rank"] = self.rank

    def scramble(self) -> None:
        """Values no step has, so a load that fills nothing cannot pass for exact."""
        with torch.no_grad():
            for p in self.model.params.values():
                p.fill_(float("nan"))
        self.extra["rank_tensor"] = torch.full((EXTRA_NUMEL,), float("nan"))
        self.extra["step"] = -1
        self.extra["rank"] = -1

    def mismatches(self, step: int) -> list[str]:
        want = expected_state(self.job, step, self.rank)
        bad = [n for n, p in self.model.params.items() if not torch.equal(p.detach(), want[n])]
        if not torch.equal(self.extra["rank_tensor"], want["extra/rank_tensor"]):
            bad.append("extra/rank_tensor")
        if self.extra.get("step") != step or self.extra.get("rank") != self.rank:
            bad.append(f"extra json {self.extra.get('step')!r}/{self.extra.get('rank')!r}")
        return bad


def _append(path: str, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _load(client: Any, rank: Rank, step: int) -> str:
    rank.scramble()
    try:
        got = client.load(rank.state, step=step)
    except Exception as exc:  # judged by the checker: a clear refusal is allowed where data was damaged
        return f"error: {type(exc).__name__}: {exc}"
    if got != step:
        return f"error: loaded step {got} instead of {step}"
    bad = rank.mismatches(step)
    return "exact" if not bad else "mismatch: " + ", ".join(bad[:5])


def train(spec: dict[str, Any], client: Any, rank: Rank) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=spec["rank"], world_size=spec["world_size"],
        timeout=timedelta(seconds=120),
    )
    latest = [client.latest() if spec["rank"] == 0 else None]
    dist.broadcast_object_list(latest, src=0)
    step = latest[0] or 0
    if step:
        for _ in range(20):  # a daemon being restarted by the chaos: try again, as a job's retry would
            result = _load(client, rank, step)
            _append(spec["log"], {"resume": step, "result": result})
            if not result.startswith("error"):
                break
            time.sleep(1.0)
        else:
            raise SystemExit(f"could not resume from step {step}: {result}")
    while True:
        step += 1
        rank.set_step(step)
        handle = client.save(step, rank.state)
        info = handle.wait_durable(timeout=90) if handle.ok else None
        if info is not None:
            _append(spec["log"], {"ack": step})
        else:
            _append(spec["log"], {"failed": step, "why": str(handle.error)[:300]})
        time.sleep(spec.get("pause_s", 0.05))


def verify(spec: dict[str, Any], client: Any, rank: Rank) -> None:
    for step in spec["steps"]:
        _append(spec["log"], {"verify": step, "result": _load(client, rank, step)})


def main() -> None:
    from ckptd.client import CheckpointClient

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    rank = Rank(spec["job"], spec["rank"])
    client = CheckpointClient(
        spec["job"], address=spec["address"], rank=spec["rank"], world_size=spec["world_size"],
        local_world_size=1, on_error="warn", timeout_s=spec.get("timeout_s", 30.0),
    )
    {"train": train, "verify": verify}[spec["mode"]](spec, client, rank)


if __name__ == "__main__":
    main()
