"""Reading and checking bytes from the page cache, one core: the client's checked read
(`pieces.read_range` of a whole piece: pread into the target + xxh3) and `ckptd verify`'s
(`verify._hash_range`: pread + xxh3 + chunk digests), with the bytes read HASH_SLICE at a time
(the hashes find them in the CPU cache) against the larger reads each used before (64 MiB and
16 MiB: the hashes read them from memory again). Warm: the file is read once before timing, so
the figures are CPU, not disk.

    python tests/bench/bench_read_hash.py --mib 256 --reps 5 --out ./bench-out
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import xxhash

from ckptd.client.reader import pieces
from ckptd.common.boxes import Box
from ckptd.common.chunks import HASH_SLICE, chunk_bytes_for
from ckptd.daemon.tools import verify

BEFORE = {"checked load": 64 * 2**20, "verify": 16 * 2**20}  # read sizes before the change


def best_gbps(nbytes: int, run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return nbytes / min(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="bytes to read, MiB (default 256)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    nbytes = args.mib * 2**20
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        path = Path(tmp) / "data.bin"
        path.write_bytes(data.tobytes())
        src = pieces.Source("t", "file", str(path), 0, nbytes, Box((0,), (nbytes,)), "U8", f"xxh3-64:{xxhash.xxh3_64_intdigest(data):016x}")
        out = np.empty(nbytes, dtype=np.uint8)
        fd = os.open(path, os.O_RDONLY)
        handle = SimpleNamespace(pread=lambda n, at: os.pread(fd, n, at))  # verify's ReadHandle over the same descriptor
        try:
            runs = {
                "checked load": (pieces, lambda: pieces.read_range(fd, src, 0, out)),
                "verify": (verify, lambda: verify._hash_range(handle, 0, nbytes, lambda n: None, chunk_bytes_for(nbytes))),
            }
            for name, (module, run) in runs.items():
                run()  # into the page cache
                figures = {}
                for label, size in (("before", BEFORE[name]), ("now", HASH_SLICE)):
                    module.HASH_SLICE = size  # each read is hashed before the next: as the code read before, at `size`
                    figures[label] = [best_gbps(nbytes, run, args.reps) for _ in range(3)]
                module.HASH_SLICE = HASH_SLICE
                for label, size in (("before", BEFORE[name]), ("now", HASH_SLICE)):
                    g = figures[label]
                    print(f"{name:<13} reads of {size >> 20:>2} MiB: {statistics.median(g):.2f} GB/s (best of {args.reps}, three rounds: "
                          f"{', '.join(f'{x:.2f}' for x in g)})")
        finally:
            os.close(fd)
    assert np.array_equal(out, data), "the checked read returned other bytes"


if __name__ == "__main__":
    main()
