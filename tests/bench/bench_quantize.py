"""Checkpoint compression (issue 4): bytes per parameter, quantizer throughput, time to durable.

One run, one state per setting, everything through a real daemon and the real client:

1. Bytes. The same state saved as each variant (lossless, O1, O2, O2 + drop, O2 + residual):
   the step's total size (every file, from the index) and bytes per parameter, for a
   mixed-precision state (bf16 weights, fp32 master weights, Adam) and an fp32 + AdamW state.
   Quantized codes are stored entropy-coded (zstd frames, ckptd.common.frames); "codes raw"
   is the same step with the codes stored as they are, for comparison. "+ zstd planes": the
   files no other tool reads (optimizer, master weights) additionally compressed losslessly by
   splitting each element's bytes into planes (byte k of every element together) and
   compressing each plane with zstd (the planes holding sign and exponent compress; the low
   mantissa planes do not, and are then kept raw) — measured, not part of the format.
2. Throughput on this machine: encode and decode GB/s of each codec (fp32 input bytes per
   second), with and without the entropy coding of the codes, the zstd byte-plane
   compressor's GB/s, and the write+fsync floor of the same disk.
3. Time to durable: save() to wait_durable() of the mixed state, lossless vs O1 vs O2 vs
   O2 + drop, in two regimes: recycled files (default retention: the files of deleted steps are
   overwritten in place) and new files (a daemon that keeps every step allocates new blocks for
   each save). Rounds of one save per variant, order rotated per round; ratios are paired
   within a round, so the machine's drift between rounds cancels.
4. Per core, over a recycled file: CPU seconds of one thread writing the mixed state's Adam
   moments as they are (the daemon's writer: pwrite over a file's existing blocks with its
   hashes) against encoding them (O1, O2: the daemon's encoder, int4 codes in zstd frames) and
   writing the codes and scales the same way. Where the first is smaller, no number of coding
   threads makes the compressed save's CPU smaller than the lossless one's.

The state is synthetic but shaped like a transformer (embeddings, attention and MLP matrices,
norms) with value distributions like trained ones: weights N(0, 0.02), first moments signed
with per-row scales spread over two decades, second moments their squares times a log-normal
factor, exact zeros in a few rows (unused embeddings).

    python tests/bench/bench_quantize.py --params 25e6 --reps 3 --out ./bench-out
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ckptd.client import CheckpointClient
from ckptd.common import codecs, frames, quant
from ckptd.common.boxes import Box
from ckptd.format.index import INDEX_NAME, CheckpointIndex
from ckptd.demo.process import start_daemon


def shapes(params: float) -> dict[str, tuple[int, ...]]:
    """A transformer's parameter shapes with about `params` parameters (d = 512, vocab 8192, untied head)."""
    d, vocab = 512, 8192
    out: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    per_layer = 12 * d * d
    layers = max(1, round((params - 2 * vocab * d) / per_layer))
    for i in range(layers):
        p = f"layers.{i}."
        out |= {
            p + "attn.qkv.weight": (3 * d, d), p + "attn.proj.weight": (d, d),
            p + "mlp.up.weight": (4 * d, d), p + "mlp.down.weight": (d, 4 * d),
            p + "norm1.weight": (d,), p + "norm2.weight": (d,),
        }
    out |= {"norm.weight": (d,), "head.weight": (vocab, d)}
    return out


def synthetic_state(setting: str, params: float, seed: int = 0) -> tuple[dict[str, Any], int]:
    """The state dict a trainer hands over, and its parameter count."""
    g = torch.Generator().manual_seed(seed)
    weights, master, opt = {}, {}, {}
    count = 0
    for name, shape in shapes(params).items():
        count += math.prod(shape)
        w = torch.randn(shape, generator=g) * 0.02 if len(shape) > 1 else 1 + 0.05 * torch.randn(shape, generator=g)
        rows = shape[0] if len(shape) > 1 else 1
        row_scale = torch.exp(torch.empty(rows).uniform_(math.log(1e-5), math.log(1e-3), generator=g))
        row_scale = row_scale.view(-1, *([1] * (len(shape) - 1))) if len(shape) > 1 else row_scale
        m = torch.randn(shape, generator=g) * row_scale
        v = (torch.randn(shape, generator=g) * row_scale) ** 2 * torch.exp(torch.randn(shape, generator=g))
        if name == "embed.weight":  # tokens never seen: no gradient, zero moments
            m[-1000:] = 0
            v[-1000:] = 0
        opt[name] = {"step": torch.tensor(1000.0), "exp_avg": m, "exp_avg_sq": v}
        if setting == "mixed":
            master[name] = w
            weights[name] = w.to(torch.bfloat16)
        else:
            weights[name] = w
    state: dict[str, Any] = {"model": weights, "optimizer": {"state": opt}}
    if setting == "mixed":
        state["master"] = master
    return state, count


VARIANTS = {
    "mixed": [("lossless", "none", "keep"), ("O1", "O1", "keep"), ("O2", "O2", "keep"), ("O2 + drop", "O2", "drop"), ("O2 + residual", "O2", "residual")],
    "fp32": [("lossless", "none", "keep"), ("O1", "O1", "keep"), ("O2", "O2", "keep")],
}


def plane_zstd_size(path: Path, level: int) -> tuple[int, int, float]:
    """(original bytes, bytes after byte-plane zstd, seconds) of one safetensors file's data."""
    import zstandard

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    total = 8 + n
    seconds = 0.0
    comp = zstandard.ZstdCompressor(level=level)
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        lo, hi = entry["data_offsets"]
        data = np.frombuffer(raw, dtype=np.uint8, count=hi - lo, offset=base + lo)
        width = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}.get(entry["dtype"], 1)
        started = time.perf_counter()
        planes = data.reshape(-1, width).T if width > 1 and len(data) else data.reshape(1, -1)
        for plane in planes:
            plane = np.ascontiguousarray(plane)
            packed = comp.compress(plane.tobytes())
            total += min(len(packed), len(plane)) + 1  # 1 byte: raw or compressed
        seconds += time.perf_counter() - started
    return len(raw), total, seconds


def save_variants(daemon: Any, setting: str, params: float) -> list[dict[str, Any]]:
    state, count = synthetic_state(setting, params)
    rows = []
    with CheckpointClient(f"bytes-{setting}", address=daemon.address, on_error="raise") as ckpt:
        for step, (name, scheme, master) in enumerate(VARIANTS[setting], start=1):
            ckpt.save(step, state, quantize=scheme, master_weights=master).wait_durable(timeout=1800)
            step_dir = daemon.root / f"bytes-{setting}" / f"step-{step:08d}"
            index = CheckpointIndex.from_json_bytes((step_dir / INDEX_NAME).read_bytes())
            size = index.size_bytes + (step_dir / INDEX_NAME).stat().st_size
            groups: dict[str, int] = {}
            for f in index.files:
                g = f.name.split("-", 1)[0].split(".", 1)[0]
                groups[g] = groups.get(g, 0) + f.size
            raw_codes = 0  # what the entropy coding took off the codes
            for t in index.tensors:
                for f in t.fragments:
                    if f.quant is not None and f.quant.frames is not None:
                        codec = codecs.codec(f.quant.codec, f.quant.block)
                        raw_codes += math.prod(codec.codes_shape(f.box.lengths)) - f.nbytes
            compressible = [step_dir / f.name for f in index.files if f.name.startswith(("optimizer-", "master_weights-"))]
            before = after = 0
            seconds = 0.0
            for path in compressible:
                b, a, s = plane_zstd_size(path, level=1)
                before, after, seconds = before + b, after + a, seconds + s
            rows.append({
                "setting": setting, "variant": name, "params": count, "bytes": size, "bytes_per_param": size / count,
                "groups": groups, "raw_codes_bytes": size + raw_codes, "zstd_bytes": size - before + after, "zstd_input": before, "zstd_seconds": seconds,
            })
    return rows


def time_it(fn: Callable[[], Any], reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def codec_throughput(reps: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    rows_scale = torch.exp(torch.empty(8192, 1).uniform_(math.log(1e-5), math.log(1e-3), generator=g))
    m = torch.randn(8192, 8192, generator=g) * rows_scale  # 256 MiB of fp32
    v = m.square() * 3
    box = Box.full(tuple(m.shape))
    out = []
    for name, block in (("lin-i8", 256), ("log-u8", 256), ("lin-i4", 128), ("log-u4", 128)):
        codec = codecs.codec(name, block)
        x = v if codec.is_log else m
        enc = time_it(lambda: codec.encode(x, box), reps)
        codes, scales = codec.encode(x, box)
        flat = codes.reshape(-1).view(torch.uint8).numpy()
        row_bytes = len(flat) // codes.shape[0]
        pack = time_it(lambda: frames.compress(flat, row_bytes), reps)
        stored, table = frames.compress(flat, row_bytes)
        unpack = time_it(lambda: frames.decompress(stored, table, 0, len(table.ends), row_bytes, codes.shape[0]), reps)
        dec = time_it(lambda: codec.decode(codes, scales, box, box), reps)
        nbytes = x.numel() * 4
        out.append({
            "codec": name, "encode_gbps": nbytes / statistics.median(enc) / 1e9, "decode_gbps": nbytes / statistics.median(dec) / 1e9,
            "entropy_encode_gbps": nbytes / (statistics.median(enc) + statistics.median(pack)) / 1e9,
            "entropy_decode_gbps": nbytes / (statistics.median(dec) + statistics.median(unpack)) / 1e9,
            "raw_fraction": (len(flat) + scales.numel() * 4) / nbytes, "stored_fraction": (len(stored) + scales.numel() * 4) / nbytes,
        })
    return out


def write_floor(out_dir: Path, nbytes: int, reps: int) -> float:
    """Seconds per byte written and fsynced (median), 64 MiB writes into a new file each rep."""

    buf = np.random.default_rng(0).integers(0, 255, 64 * 2**20, dtype=np.uint8)
    times = []
    for rep in range(reps):
        path = out_dir / f"floor-{rep}.bin"
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(nbytes // len(buf)):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - started)
        path.unlink()
    return statistics.median(times) / nbytes


DURABLE_VARIANTS = {"lossless": ("none", "keep"), "O1": ("O1", "keep"), "O2": ("O2", "keep"), "O2 + drop": ("O2", "drop")}
# A daemon with the default retention overwrites the files of deleted steps (the steady state of
# a training run); one that keeps every step writes new files, so every save allocates new blocks.
DURABLE_REGIMES = {"recycled files": 3, "new files": 0}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def durable_times(out_dir: Path, shm: Path, params: float, reps: int, keep_last: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds from save() to wait_durable() of the mixed state per variant, and the daemon's CPU
    seconds in the same span (its encoding and writing; the copy is the trainer's): `reps` rounds, each
    saving every variant once in an order rotated per round (each variant follows each other
    equally often: a save inherits the previous one's writeback). Each variant is its own job,
    as in a training run that always saves the same way: with retention, a save overwrites the
    files of its own job's deleted steps. Warm-up rounds first: new arenas, and until retention
    deletes a step there is nothing to recycle."""
    state, _ = synthetic_state("mixed", params, seed=3)
    names = list(DURABLE_VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    root = out_dir / f"root-keep-{keep_last}"
    daemon = start_daemon(root, shm / f"keep-{keep_last}.sock", ["--shm-dir", str(shm), "--keep-last", str(keep_last)])
    clients = {name: CheckpointClient(f"durable-{i}", address=daemon.address, on_error="raise") for i, name in enumerate(names)}
    try:
        step = 0
        for rnd in range(-(keep_last + 1), reps):
            step += 1
            for i in range(len(names)):
                name = names[(i + rnd) % len(names)]
                scheme, master = DURABLE_VARIANTS[name]
                started, cpu_before = time.perf_counter(), process_cpu_s(daemon.popen.pid)
                clients[name].save(step, state, quantize=scheme, master_weights=master).wait_durable(timeout=1800)
                if rnd >= 0:
                    times[name].append(time.perf_counter() - started)
                    cpu[name].append(process_cpu_s(daemon.popen.pid) - cpu_before)
    finally:
        for client in clients.values():
            client.close()
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return times, cpu


def per_core_cost(out_dir: Path, params: float, reps: int) -> dict[str, list[float]]:
    """CPU seconds of one thread to put the mixed state's 2-D Adam moments into a file whose
    blocks already exist, per scheme: None writes them as they are, O1/O2 encode them first and
    write codes and scales. Uses the daemon's own writer step (writer._write_bytes: pwrite 1 MiB
    at a time with the whole-tensor and chunk hashes, then start_writeback)."""
    from ckptd.daemon.write import writer
    from ckptd.daemon.storage.fs import pwrite_all, start_writeback

    class FilePart:
        """The writer's PartWriter over this benchmark's own file (no rename, no publish)."""

        def __init__(self, fd: int) -> None:
            self.fd = fd

        def pwrite(self, offset: int, view: memoryview) -> None:
            pwrite_all(self.fd, view, offset)

        def start_writeback(self, offset: int, nbytes: int) -> bool:
            return start_writeback(self.fd, offset, nbytes)

    state, _ = synthetic_state("mixed", params, seed=3)
    moments = [
        (f"optimizer/state/{name}/{field}", t)
        for name, fields in state["optimizer"]["state"].items()
        for field, t in fields.items()
        if t.dim() >= 2
    ]
    path = out_dir / "per-core.bin"
    nbytes = sum(t.nbytes for _, t in moments)
    throttle = writer.Throttle(0)
    scratch = quant.Scratch()  # reused from tensor to tensor, as the daemon's coding jobs do

    def write(data: np.ndarray, offset: int) -> int:
        writer._write_bytes(part, memoryview(data), offset, throttle)  # type: ignore[arg-type]
        return offset + data.nbytes

    def save(scheme: str | None) -> None:
        offset = 0
        for name, t in moments:
            codec = codecs.codec_for(scheme, name, "optimizer", "F32", tuple(t.shape))
            if codec is None:
                offset = write(t.view(-1).view(torch.uint8).numpy(), offset)
                continue
            codes, scales = codec.encode(t, Box.full(tuple(t.shape)), scratch)
            flat = codes.view(-1).view(torch.uint8).numpy()
            if codec.framed:
                flat, _ = frames.compress(flat, flat.size // codes.shape[0])
            offset = write(scales.view(-1).view(torch.uint8).numpy(), write(flat, offset))

    cpu: dict[str, list[float]] = {"lossless": [], "O1": [], "O2": []}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    part = FilePart(fd)
    try:
        # The blocks exist and their pages are cached as the daemon wrote them, as a recycled
        # file's are: a file made by one big write() costs about 3x the CPU to overwrite here
        # (its cached pages are small folios), which made writing raw look that much dearer.
        for offset in range(0, nbytes, writer.WRITE_CHUNK):
            writer._write_bytes(part, memoryview(bytes(min(writer.WRITE_CHUNK, nbytes - offset))), offset, throttle)  # type: ignore[arg-type]
        for _ in range(reps + 1):  # the first round warms up
            for name, scheme in (("lossless", None), ("O1", "O1"), ("O2", "O2")):
                os.fsync(fd)  # the file's pages clean, as a recycled file's are (deleted steps were durable)
                started = time.thread_time()
                save(scheme)
                cpu[name].append(time.thread_time() - started)
    finally:
        os.close(fd)
        path.unlink()
    return {name: seconds[1:] for name, seconds in cpu.items()}


def paired_ratios(times: dict[str, list[float]], name: str) -> list[float]:
    """Per round: the variant's time over the lossless save's of the same round."""
    return [t / base for t, base in zip(times[name], times["lossless"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=25e6, help="parameters of the synthetic model (default 25e6)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on the disk under test")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["bytes", "codecs", "durable", "per-core"])
    parser.add_argument("--regimes", nargs="*", default=list(DURABLE_REGIMES), choices=list(DURABLE_REGIMES), help="time to durable: which regimes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"params": args.params}
    with tempfile.TemporaryDirectory(prefix="ckptd-bq-", dir="/dev/shm") as shm, tempfile.TemporaryDirectory(prefix="ckptd-bq-", dir=args.out) as tmp:
        daemon = start_daemon(Path(tmp) / "root", Path(shm) / "d.sock", ["--shm-dir", shm, "--keep-last", "0"])
        try:
            if "bytes" not in args.skip:
                rows = save_variants(daemon, "mixed", args.params) + save_variants(daemon, "fp32", args.params)
                results["bytes"] = rows
                print(f"{'setting':<7} {'variant':<15} {'bytes/param':>11} {'total':>12} {'vs lossless':>11} {'codes raw':>9} {'vs lossless':>11} "
                      f"{'+ zstd planes':>14} {'B/param':>8} {'vs lossless':>11}")
                for r in rows:
                    base = next(x for x in rows if x["setting"] == r["setting"] and x["variant"] == "lossless")
                    print(f"{r['setting']:<7} {r['variant']:<15} {r['bytes_per_param']:>11.3f} {r['bytes'] / 1e6:>10.1f}MB "
                          f"{100 * (r['bytes'] / base['bytes'] - 1):>+10.2f}% {r['raw_codes_bytes'] / r['params']:>9.3f} "
                          f"{100 * (r['raw_codes_bytes'] / base['bytes'] - 1):>+10.2f}% {r['zstd_bytes'] / 1e6:>12.1f}MB "
                          f"{r['zstd_bytes'] / r['params']:>8.3f} {100 * (r['zstd_bytes'] / base['bytes'] - 1):>+10.1f}%")
                zin = sum(r["zstd_input"] for r in rows)
                zs = sum(r["zstd_seconds"] for r in rows)
                print(f"zstd byte-plane compressor: {zin / zs / 1e9:.3f} GB/s of input (level 1, one thread)")
                results["zstd_gbps"] = zin / zs / 1e9
            if "codecs" not in args.skip:
                floor = write_floor(Path(tmp), 512 * 2**20, args.reps)
                results["write_floor_gbps"] = 1 / floor / 1e9
                results["codecs"] = codec_throughput(args.reps)
                print(f"write + fsync floor: {1 / floor / 1e9:.2f} GB/s")
                for r in results["codecs"]:
                    # quantizing pays when encoding 1 byte takes less than writing the bytes it saves
                    breakeven = (1 / floor / 1e9) / (1 - r["stored_fraction"])
                    print(f"{r['codec']:<7} encode {r['encode_gbps']:.2f} GB/s, with zstd frames {r['entropy_encode_gbps']:.2f}  "
                          f"decode {r['decode_gbps']:.2f}, with frames {r['entropy_decode_gbps']:.2f}  "
                          f"stored {r['raw_fraction']:.3f} of the fp32 bytes, with frames {r['stored_fraction']:.3f}; "
                          f"break-even encode speed vs the floor {breakeven:.2f} GB/s")
        finally:
            daemon.stop()
        if "per-core" not in args.skip:
            cpu = per_core_cost(Path(tmp), args.params, args.reps)
            results["per_core_cpu_seconds"] = cpu
            base = statistics.median(cpu["lossless"])
            for name, seconds in cpu.items():
                print(f"per core, recycled file, moments ({name}): CPU {statistics.median(seconds):.4f} s "
                      f"[{min(seconds):.4f} - {max(seconds):.4f}], {statistics.median(seconds) / base:.2f}x writing them as they are")
        if "durable" not in args.skip:
            results["durable"] = {}
            for regime in args.regimes:
                times, cpu = durable_times(Path(tmp), Path(shm), args.params, args.reps, DURABLE_REGIMES[regime])
                results["durable"][regime] = {"seconds": times, "daemon_cpu_seconds": cpu}
                for name, ts in times.items():
                    line = f"time to durable, mixed state, {regime:<14} {name:<10} median {statistics.median(ts):.3f} s  [{min(ts):.3f} - {max(ts):.3f}]"
                    if name != "lossless":
                        r = sorted(paired_ratios(times, name))
                        q1, q3 = r[len(r) // 4], r[(3 * len(r)) // 4]
                        line += f"  vs lossless, same round: median {statistics.median(r):.2f}x [quartiles {q1:.2f} - {q3:.2f}]"
                    print(line + f"  daemon CPU {statistics.median(cpu[name]):.3f} s  n={len(ts)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
