"""Coverage check benchmark: how long ckptd takes to decide whether the chunks of one tensor tile
it exactly (`common.boxes.coverage_problems`, run on every save plan and on every imported DCP
`.metadata`), against DCP's own check of a global save plan
(`torch.distributed.checkpoint.default_planner._validate_global_plan`), on the same chunks.

Layouts of `--chunks` chunks of one tensor (default 40,000): rows, columns, a 2-D grid, a 3-D
grid, and three damaged ones (a grid with one chunk moved onto its neighbour, a grid with one
chunk missing, columns with one chunk grown over the next). Each round times both checks on
each layout, interleaved, in CPU seconds (`time.process_time`: other work on the machine does
not count); the table gives the median per layout and the ratio ckptd / DCP. DCP's check is
skipped on a layout once one round of it takes over `--dcp-limit-s` (its sweep is quadratic
where many chunks share a band along its sweep dimension).

Note what each check decides: DCP's finds overlapping pairs and compares the sum of the volumes
with the tensor's, so a gap hidden by an overlap elsewhere passes it; ckptd's verdict is exact.

Usage: python tests/bench/bench_coverage.py [--chunks 40000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time
from typing import Callable

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from ckptd.common.boxes import Box, coverage_problems


def grid(shape: tuple[int, ...], splits: tuple[int, ...]) -> list[Box]:
    """`shape` cut into `splits[d]` equal pieces along each dimension d, in row-major order."""
    sizes = [s // k for s, k in zip(shape, splits)]
    boxes = []
    for index in range(math.prod(splits)):
        offsets = []
        for d in reversed(range(len(shape))):
            index, k = divmod(index, splits[d])
            offsets.append(k * sizes[d])
        boxes.append(Box(tuple(reversed(offsets)), tuple(sizes)))
    return boxes


def layouts(chunks: int) -> dict[str, tuple[tuple[int, ...], list[Box]]]:
    side = max(2, round(math.sqrt(chunks)))
    cube = max(2, round(chunks ** (1 / 3)))
    out = {
        "rows": ((chunks, 4), grid((chunks, 4), (chunks, 1))),
        "columns": ((4, chunks), grid((4, chunks), (1, chunks))),
        "grid": ((side * 4, side * 4), grid((side * 4, side * 4), (side, side))),
        "grid3": ((cube * 2,) * 3, grid((cube * 2,) * 3, (cube,) * 3)),
    }
    shape, boxes = out["grid"]
    moved = list(boxes)
    moved[side * (side // 2)] = Box((side * 2 + 2, 0), (4, 4))  # first chunk of the middle band, 2 rows down
    out["grid-one-overlap"] = (shape, moved)
    out["grid-one-gap"] = (shape, boxes[: len(boxes) // 3] + boxes[len(boxes) // 3 + 1 :])
    shape, boxes = out["columns"]
    out["columns-one-grown"] = (shape, [Box((0, 7), (4, 2)) if k == 7 else b for k, b in enumerate(boxes)])
    return out


def dcp_check(shape: tuple[int, ...], boxes: list[Box]) -> Callable[[], object]:
    chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.lengths)) for b in boxes]
    meta = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)})
    plans = [SavePlan([]), SavePlan([])]  # two ranks: DCP compares volumes only for more than one
    return lambda: _validate_global_plan(plans, meta)


def cpu_seconds(check: Callable[[], object]) -> float:
    started = time.process_time()
    check()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dcp-limit-s", type=float, default=30.0)
    args = parser.parse_args()
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)  # DCP logs each problem
    cases = layouts(args.chunks)
    ours: dict[str, list[float]] = {name: [] for name in cases}
    dcp: dict[str, list[float]] = {name: [] for name in cases}
    verdicts: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, (shape, boxes) in cases.items():
            problems: list[str] = []
            ours[name].append(cpu_seconds(lambda: problems.extend(coverage_problems(shape, boxes))))
            verdicts[name] = len(problems)
            if not dcp[name] or dcp[name][-1] <= args.dcp_limit_s:
                dcp[name].append(cpu_seconds(dcp_check(shape, boxes)))
    print(f"load average {os.getloadavg()[0]:.1f}; CPU seconds, median of {args.rounds} rounds")
    print(f"{'layout':<20} {'chunks':>7} {'ckptd':>8} {'DCP':>9} {'ckptd/DCP':>10}  problems found by ckptd")
    for name, (_, boxes) in cases.items():
        mine, theirs = statistics.median(ours[name]), statistics.median(dcp[name])
        skipped = "" if len(dcp[name]) == args.rounds else f" (DCP timed once: over {args.dcp_limit_s:.0f} s)"
        print(f"{name:<20} {len(boxes):>7} {mine:>8.3f} {theirs:>9.3f} {mine / theirs:>10.3f}  {verdicts[name]}{skipped}")


if __name__ == "__main__":
    main()
