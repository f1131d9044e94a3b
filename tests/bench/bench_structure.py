"""A new client's first walk and structure build of a plain state, per tensor (issue 33, item 5).

What a restarted trainer (a new CheckpointClient) pays in Python before its first load or save
copies anything: (a) `StateWalk().flatten` of the state (ckptd.client.walk) and (b)
`StructureCache().for_state` of the result (ckptd.client.structure: validation, fragments,
fingerprint), both on fresh objects each round, at 100, 1,000 and 4,000 tensors of
bench_counts.counts_state (an fp32 model with AdamW's two moments, no layout rules).

Prints µs per tensor of each, and of both together: the median and the min over --rounds. The
two are timed back to back in each round, in one process, so a run on another tree (A/B against
a branch point: PYTHONPATH=<tree>/client:<tree>/daemon python <this file>) compares like with
like. No daemon, no I/O. Exit 0.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench is not a package
import bench_counts  # noqa: E402

from ckptd.client.structure import StructureCache  # noqa: E402
from ckptd.client.walk import StateWalk  # noqa: E402

MIB = 1 << 20


def one_round(state: dict, n: int) -> tuple[float, float]:
    """µs per tensor of a fresh StateWalk's flatten and a fresh StructureCache's for_state."""
    gc.collect()
    start = time.perf_counter()
    flat = StateWalk().flatten(state, rank=0)
    walked = time.perf_counter()
    StructureCache().for_state(flat, None, None)
    built = time.perf_counter()
    return (walked - start) * 1e6 / n, (built - walked) * 1e6 / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", default="100,1000,4000", help="comma-separated tensor counts (default 100,1000,4000)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per count (default 30)")
    parser.add_argument("--size-mib", type=int, default=16, help="bytes of the state (default 16; the cost does not depend on it)")
    args = parser.parse_args()
    print(f"{'tensors':>8}  {'flatten µs/t (med, min)':>24}  {'for_state µs/t (med, min)':>26}  {'both µs/t (med, min)':>22}")
    for count in (int(c) for c in args.tensors.split(",")):
        state = bench_counts.counts_state(count, args.size_mib * MIB, seed=count)
        n = len(StateWalk().flatten(state, rank=0).tensors)
        for _ in range(3):  # warm-up: imports, caches of torch and of the interpreter
            one_round(state, n)
        rounds = [one_round(state, n) for _ in range(args.rounds)]
        walk = [r[0] for r in rounds]
        build = [r[1] for r in rounds]
        both = [r[0] + r[1] for r in rounds]
        print(
            f"{n:>8,}  {statistics.median(walk):>14.2f} {min(walk):>9.2f}  {statistics.median(build):>16.2f} {min(build):>9.2f}"
            f"  {statistics.median(both):>12.2f} {min(both):>9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
