"""Bench: the client's Python cost per piece of filling a load's targets when a load has many
pieces (issue 34: a replaced node's ranks load row slices of thousands of tensors).

Per "PIECES:MiB" of `--sweep`: PIECES fp32 tensors of MiB in all, each stored as one fragment
(all of its rows) in one file per source kind, as a load finds them:

- **shm**: an arena in /dev/shm (SHM_SOURCE), copied through a fresh mapping each round (a first,
  cold load, not the memoized plan of a repeated one);
- **checked**: a staging file in /dev/shm whose bytes the daemon checked (CHECKED_SOURCE): read
  unchecked;
- **file**: a committed file with the index's chunk checksums (FILE_SOURCE), warm in the page
  cache: read and checked by the rank (the chunks each slice touches).

Each target is a row slice of its tensor (the middle half of its rows), so every piece is one
byte range of its fragment. In each round, for each kind in turn (the order rotates round by
round), `fill_all` fills every target on a pool of BATCHES threads; measured: the calling
thread's CPU per piece (the Python of planning the copies: what grows with the pieces, while
the bytes stay the same), the process's CPU per piece (with the pool threads: the copies, the
reads, the checks) and the wall time. Every target is compared with the saved rows.

Target (issue 34, helper's brief): the calling thread's CPU per piece <= 20 us at 1,000 and
4,000 pieces, for every kind (median of the rounds). The load average is printed at the start
and the end: the machine is shared, so CPU time is the figure to trust, not the wall time.

    python tests/bench/bench_fill.py             # 1,000 and 4,000 pieces of 256 MiB, 5 rounds: about a minute on 2 idle cores
    python tests/bench/bench_fill.py --quick     # a small sample (CI: tests/test_bench_fill.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

from ckptd.client.arenas import ArenaMaps
from ckptd.client.reader.fill import BATCHES, Fill, fill_all
from ckptd.client.reader.pieces import Source
from ckptd.common.boxes import Box
from ckptd.common.chunks import ChunkHasher, chunk_bytes_for
from ckptd.format.file_plan import CHECKED_SOURCE

TARGET_US = 20.0  # calling thread's CPU per piece
KINDS = ("shm", CHECKED_SOURCE, "file")
COLS = 256


def make_tensors(pieces: int, mib: int) -> list[torch.Tensor]:
    """`pieces` fp32 tensors of COLS columns, `mib` MiB in all (at least 4 rows each), random values."""
    rows = max(4, mib * 2**20 // pieces // 4 // COLS)
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, COLS, generator=g) for _ in range(pieces)]


def store(kind: str, tensors: list[torch.Tensor], where: Path) -> list[Source]:
    """Every tensor as one fragment, back to back in one file; their sources."""
    path = where / f"pieces-{kind}.bin"
    sources = []
    with open(path, "wb") as f:
        for i, t in enumerate(tensors):
            data = t.numpy().tobytes()
            chunk = chunk_bytes_for(len(data)) if kind == "file" else 0
            hasher = ChunkHasher(chunk) if chunk else None
            if hasher is not None:
                hasher.update(data)
            box = Box.full(tuple(t.shape))
            checksum = f"xxh3-64:{xxhash.xxh3_64_intdigest(data):016x}"
            sources.append(Source(f"t{i}", kind, str(path), f.tell(), len(data), box, "F32", checksum, chunk,
                                  hasher.hexdigests() if hasher is not None else ""))
            f.write(data)
    return sources


def slice_of(t: torch.Tensor) -> Box:
    """The middle half of the tensor's rows."""
    rows = t.shape[0]
    return Box((rows // 4, 0), (rows // 2, t.shape[1]))


def one_fill(pool: ThreadPoolExecutor, sources: list[Source], tensors: list[torch.Tensor]) -> tuple[float, float, float]:
    """Fill fresh targets from `sources` through a fresh ArenaMaps; (caller CPU us per piece,
    process CPU us per piece, wall ms). Raises SystemExit when a target comes back wrong."""
    wants = [slice_of(t) for t in tensors]
    fills = [Fill(torch.empty(w.lengths), w, [s]) for w, s in zip(wants, sources)]
    maps = ArenaMaps()
    try:
        thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
        fill_all(pool, maps, fills)
        thread, process, wall = time.thread_time() - thread, time.process_time() - process, time.perf_counter() - wall
    finally:
        maps.close()
    for fill, t, w in zip(fills, tensors, wants):
        if not torch.equal(fill.target, t[w.offsets[0] : w.offsets[0] + w.lengths[0]]):
            raise SystemExit(f"{sources[0].kind}: tensor {fill.sources[0].name} came back wrong")
    n = len(fills)
    return thread / n * 1e6, process / n * 1e6, wall * 1e3


def run(pieces: int, mib: int, rounds: int, out: Path) -> list[str]:
    """One sweep point; the summary lines (a PASS/FAIL per kind)."""
    tensors = make_tensors(pieces, mib)
    lines = []
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ckptd-bench-fill-") as shm, \
            tempfile.TemporaryDirectory(dir=out, prefix="bench-fill-") as disk, ThreadPoolExecutor(BATCHES) as pool:
        sources = {kind: store(kind, tensors, Path(disk if kind == "file" else shm)) for kind in KINDS}
        for kind in KINDS:  # once untimed: the file into the page cache, the pool's threads started
            one_fill(pool, sources[kind], tensors)
        figures: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
        for r in range(rounds):
            order = KINDS[r % len(KINDS):] + KINDS[: r % len(KINDS)]
            for kind in order:
                figures[kind].append(one_fill(pool, sources[kind], tensors))
            print(f"  round {r + 1}: " + ", ".join(f"{k} {figures[k][-1][0]:.1f} us/piece ({figures[k][-1][2]:.0f} ms)" for k in KINDS), flush=True)
    total = sum(t.numel() * 2 for t in tensors)  # bytes filled: half of every tensor's fp32 bytes
    for kind in KINDS:
        caller = statistics.median(f[0] for f in figures[kind])
        process = statistics.median(f[1] for f in figures[kind])
        wall = statistics.median(f[2] for f in figures[kind])
        ok = caller <= TARGET_US
        lines.append(f"{pieces} pieces, {total / 2**20:.0f} MiB filled, {kind}: calling thread {caller:.1f} us/piece (target <= {TARGET_US:.0f}: "
                     f"{'PASS' if ok else 'FAIL'}), process {process:.1f} us/piece, wall {wall:.1f} ms")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="1000:256,4000:256", help="PIECES:MiB,... (default 1000:256,4000:256)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="200 pieces of 16 MiB, 2 rounds")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()), help="where the file kind's file goes (default: the temp dir)")
    args = parser.parse_args()
    sweep, rounds = ("200:16", 2) if args.quick else (args.sweep, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {BATCHES} pool threads", flush=True)
    summary = []
    for point in sweep.split(","):
        pieces, mib = (int(x) for x in point.split(":"))
        print(f"{pieces} pieces, {mib} MiB:", flush=True)
        summary += run(pieces, mib, rounds, args.out)
    print("\nsummary")
    for line in summary:
        print(line)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
