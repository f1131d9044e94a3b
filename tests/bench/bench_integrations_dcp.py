"""Stall of dcp.save through ckptd (CkptdStorageWriter) against DCP's own saving, interleaved.

For each tensor count in --tensors (default 100 and 1,000) a state {"model": {...}} of fp32
tensors totalling about --mib MiB is saved, per round, three ways back to back:

- dcp: `dcp.save` with DCP's FileSystemWriter (DCP's default: the call returns once written);
- dcp-async: `dcp.async_save` with FileSystemWriter; stall = until the call returns (its staging
  copy), the write finishes in DCP's thread (waited for, untimed, before the next segment);
- ckptd: `dcp.save` with CkptdStorageWriter and its planner (`writer.planner`: DCP's plans kept
  while the state's structure is unchanged); stall = until the call returns (the hand-off to the
  daemon's shared memory), the daemon writes in the background (waited for, untimed);
- ckptd-async: `dcp.async_save` with the same writer and planner; stall = until the call returns
  (the writer is DCP's stager: the save thread's hand-off, no copy by DCP first).

Every value changes before each round. Ratios are taken within a round; the median over the
rounds is printed with min and max. Run: `python tests/bench/bench_integrations_dcp.py
[--rounds 5] [--tensors 100 1000] [--mib 128]`. Scratch files, the daemon and its arenas are
removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ckptd.demo.process import start_daemon
from ckptd.integrations.dcp import CkptdStorageWriter


def make_state(count: int, mib: int) -> dict[str, dict[str, torch.Tensor]]:
    per = max(1, mib * 2**20 // 4 // count)
    return {"model": {f"layer{i}.weight": torch.randn(per) for i in range(count)}}


def touch(state: dict[str, dict[str, torch.Tensor]]) -> None:
    for t in state["model"].values():
        t.add_(1.0)


def run(rounds: int, counts: list[int], mib: int) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="ckptd-bench-dcp-"))
    shm = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
    daemon = start_daemon(root=scratch / "root", socket=scratch / "d.sock", extra_args=["--shm-dir", str(shm)], log_path=scratch / "daemon.log")
    try:
        print(f"{'tensors':>8} {'MiB':>5}  {'dcp s':>8} {'dcp-async s':>11} {'ckptd s':>8} {'ckptd-async s':>13}  {'dcp/ckptd':>16} {'async/ckptd':>16} {'async/ckptd-async':>17}")
        for count in counts:
            state = make_state(count, mib)
            writer = CkptdStorageWriter(f"bench-{count}", address=daemon.address)
            step = 0
            for _ in range(2):  # warm-up: plans, arenas, page cache
                step += 1
                dcp.save(state, storage_writer=writer, checkpoint_id=step, planner=writer.planner)
                assert writer.handle is not None
                writer.handle.wait_durable(timeout=600)
                step += 1
                dcp.async_save(state, storage_writer=writer, checkpoint_id=step, planner=writer.planner).result()
                writer.handle.wait_durable(timeout=600)
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(scratch / f"warm-{count}-{step}")))
            times: dict[str, list[float]] = {"dcp": [], "async": [], "ckptd": [], "ckptd-async": []}
            for r in range(rounds):
                touch(state)
                target = scratch / f"dcp-{count}-{r}"
                started = time.perf_counter()
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)))
                times["dcp"].append(time.perf_counter() - started)
                shutil.rmtree(target)

                touch(state)
                started = time.perf_counter()
                future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(target)))
                times["async"].append(time.perf_counter() - started)
                result = getattr(future, "upload_completion", future)
                result.result()
                shutil.rmtree(target)

                touch(state)
                step += 1
                started = time.perf_counter()
                dcp.save(state, storage_writer=writer, checkpoint_id=step, planner=writer.planner)
                times["ckptd"].append(time.perf_counter() - started)
                assert writer.handle is not None
                writer.handle.wait_durable(timeout=600)

                touch(state)
                step += 1
                started = time.perf_counter()
                future = dcp.async_save(state, storage_writer=writer, checkpoint_id=step, planner=writer.planner)
                times["ckptd-async"].append(time.perf_counter() - started)
                future.result()
                writer.handle.wait_durable(timeout=600)
            writer.close()
            ratio = [d / c for d, c in zip(times["dcp"], times["ckptd"])]
            ratio_async = [a / c for a, c in zip(times["async"], times["ckptd"])]
            ratio_both = [a / c for a, c in zip(times["async"], times["ckptd-async"])]
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"{count:>8} {mib:>5}  {med['dcp']:>8.3f} {med['async']:>11.3f} {med['ckptd']:>8.3f} {med['ckptd-async']:>13.3f}  "
                f"{statistics.median(ratio):>5.1f} [{min(ratio):.1f}-{max(ratio):.1f}] {statistics.median(ratio_async):>6.1f} [{min(ratio_async):.1f}-{max(ratio_async):.1f}]"
                f" {statistics.median(ratio_both):>7.1f} [{min(ratio_both):.1f}-{max(ratio_both):.1f}]"
            )
    finally:
        daemon.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tensors", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--mib", type=int, default=128)
    args = p.parse_args(argv)
    return run(args.rounds, args.tensors, args.mib)


if __name__ == "__main__":
    sys.exit(main())
