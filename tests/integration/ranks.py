"""Trainer ranks as real processes, for the integration tests: `python ranks.py MODE ...`.

Modes:
  save ADDRESS JOB RANK WORLD STEP OUT_JSON   save a deterministic replicated model, report what was copied
  die-mid-save ADDRESS JOB RANK WORLD STEP    join the save, copy half of its slots, then SIGKILL itself
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import sys

import torch
from torch import nn

from ckptd.client import CheckpointClient
from ckptd.client._rpc import tensor_meta
from ckptd.client.structure import fingerprint_of, fragments_of_state
from ckptd.client.state import flatten_state
from ckptd.wire.v1 import checkpoint_pb2 as pb


def replicated_model() -> nn.Module:
    torch.manual_seed(0)  # identical on every rank: a DDP replica
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])


def save(address: str, job: str, rank: int, world: int, step: int, out: str) -> None:
    with CheckpointClient(job, address=address, rank=rank, world_size=world, on_error="raise", timeout_s=60) as ckpt:
        handle = ckpt.save(step, {"model": replicated_model(), "extra": {"rank": rank}})
        info = handle.wait_durable(timeout=60)
    with open(out, "w") as f:
        json.dump({"bytes_copied": handle.bytes_copied, "step_dir": info.step_dir if info else None}, f)


def die_mid_save(address: str, job: str, rank: int, world: int, step: int) -> None:
    """Speak the protocol by hand to stop at an exact point: arena half written, never committed."""
    ckpt = CheckpointClient(job, address=address, rank=rank, world_size=world, on_error="raise", timeout_s=60)
    flat = flatten_state({"model": replicated_model()}, rank=rank)
    fragments = fragments_of_state(flat)
    reply = ckpt._rpc.stub.BeginSave(
        pb.BeginSaveRequest(who=ckpt._rpc.who, step=step, fingerprint=fingerprint_of(flat, fragments), tensors=[tensor_meta(e, f) for e, f in fragments], timeout_s=60),
        timeout=60,
    )
    fd = os.open(reply.arena_path, os.O_RDWR)
    arena = mmap.mmap(fd, reply.arena_size)
    for slot in reply.slots[: len(reply.slots) // 2]:
        arena[slot.offset : slot.offset + slot.nbytes] = b"\xff" * slot.nbytes
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, address, job, rank, world, step, *rest = sys.argv[1:]
    if mode == "save":
        save(address, job, int(rank), int(world), int(step), rest[0])
    elif mode == "die-mid-save":
        die_mid_save(address, job, int(rank), int(world), int(step))
    else:
        raise SystemExit(f"unknown mode {mode}")
