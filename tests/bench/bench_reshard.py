"""Resharded restore benchmark: ckptd's cold restore into other layouts, against its same-layout
restore and against torch.distributed.checkpoint (DCP) doing the same.

One run, on one state of `--size-gib` fp32 tensors (34 2-D tensors shaped like a transformer's
weights; no row count divides by 3 or 4, and some column counts are odd), held as DTensors on a
1-D `cpu` device mesh by rank processes (gloo on 127.0.0.1, one torch thread each):

- save once with 4 ranks, Shard(0): through a real ckptd daemon (`save` + `wait_durable`) and
  with `dcp.save` (FileSystemWriter, fsync), both to `--out`;
- restore, cold, into three layouts: 4 ranks Shard(0) (the same layout), 3 ranks Shard(0)
  (resharded, uneven) and 2 ranks Shard(1) (resharded along the other dim). "Cold": for ckptd
  the daemon is stopped, the page cache dropped and a new daemon started on the same root, so the
  restore is that daemon's first load; for DCP the page cache is dropped. All ranks start the
  load together after a barrier; a restore's time is the slowest rank's, from just before
  `load` to just after it (process start-up, the client's connection setup and the check are
  outside it). Every restored element is compared with the saved value (the values are a hash of
  the tensor and the global element index, so each rank computes what its slice must hold).

It prints a table and the ratios: ckptd resharded / ckptd same layout (target <= 1.5), ckptd /
DCP per target layout (no target), and the bytes each rank handed over in the 4-rank ckptd save
(`handle.bytes_copied`), max / mean. Run as root for real cold reads. Exits 0 whether targets
pass or fail; 1 only if a part could not run or a restore came back wrong.

- nodes: the bytes each node writes in a replicated save: 2 daemons on loopback (`--peers`,
  each with its own root), 4 ranks (2 per daemon, threads with their own client) saving the same
  state as plain, replicated tensors (data parallelism); each root's data files are summed and
  compared, max / mean (target <= 1.1).

Rank processes are this script run again with `--worker SPEC_JSON` (no pickle crosses processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_save import (  # noqa: E402  (a script beside this one, not a package)
    GIB,
    JOB,
    DaemonRig,
    Timing,
    drop_page_cache,
    files_under,
    free_port,
    load_average,
    machine_info,
    newest_in_memory,
)

PARTS = ("ckptd", "dcp", "nodes")
NODE_LIMIT = 1.1  # bytes written per node in a replicated save, max / mean
LAYERS = 8
STEP = 1
RANK_TIMEOUT_S = 900.0  # how long one job of rank processes may take, start-up included
RESHARD_LIMIT = 1.5  # ckptd resharded / ckptd same layout


# ------------------------------------------------------------------ layouts and the state


@dataclass(frozen=True)
class Layout:
    """`world` ranks on a 1-D cpu mesh, every tensor Shard(`dim`)."""

    world: int
    dim: int

    @property
    def key(self) -> str:
        return f"{self.world}xS{self.dim}"

    @property
    def label(self) -> str:
        return f"{self.world} ranks Shard({self.dim})"


SAVE_LAYOUT = Layout(4, 0)
SAME = Layout(4, 0)
RESHARDED = (Layout(3, 0), Layout(2, 1))
LOAD_LAYOUTS = (SAME, *RESHARDED)


def uneven(n: int) -> int:
    """The smallest count >= n that neither 3 nor 4 divides: shards over 3 and 4 ranks are uneven."""
    while n % 3 == 0 or n % 4 == 0:
        n += 1
    return n


def tensor_shapes(total_bytes: int, layers: int = LAYERS) -> dict[str, tuple[int, int]]:
    """Name -> (rows, cols) of fp32 tensors totalling about (not over, bar rounding) total_bytes.

    Embedding and lm_head are (8h, h); each layer has qkv (3h, h), out (h, h), up (4h, h) and
    down (h, 4h + 1): 112 h^2 elements at 8 layers, h a multiple of 64. Row counts are made
    uneven(); down's odd column count makes Shard(1) over 2 ranks uneven too.
    """
    h = max(64, int(math.sqrt(total_bytes / 4 / (16 + 12 * layers))) // 64 * 64)
    shapes = {"embed.weight": (uneven(8 * h), h)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes[p + "attn.qkv.weight"] = (uneven(3 * h), h)
        shapes[p + "attn.out.weight"] = (uneven(h), h)
        shapes[p + "mlp.up.weight"] = (uneven(4 * h), h)
        shapes[p + "mlp.down.weight"] = (uneven(h), 4 * h + 1)
    shapes["lm_head.weight"] = (uneven(8 * h), h)
    return shapes


def shapes_bytes(shapes: dict[str, tuple[int, int]]) -> int:
    return sum(r * c * 4 for r, c in shapes.values())


def block_values(index: int, cols: int, offset: tuple[int, ...], local_shape: tuple[int, ...]) -> torch.Tensor:
    """The saved values of rows/cols [offset, offset + local_shape) of tensor number `index`.

    A hash of (index, global element index), exact in fp32 (24-bit integers / 2^24, in [0, 1)),
    so a slice that came from the wrong place, tensor or rank does not match.
    """
    rows = torch.arange(offset[0], offset[0] + local_shape[0], dtype=torch.int64)
    columns = torch.arange(offset[1], offset[1] + local_shape[1], dtype=torch.int64)
    h = (rows[:, None] * cols + columns[None, :]).mul_(2654435761).add_((index + 1) * 0x9E3779B1)  # < 2^61
    h.bitwise_xor_(h >> 29).bitwise_and_(0xFFFFFF)
    return h.to(torch.float32).div_(2**24)


# ------------------------------------------------------------------ a rank (runs in its own process)


def build_model(total_bytes: int, layout: Layout, fill: bool) -> dict[str, Any]:
    """{name: DTensor} of this rank's shards in `layout`: the saved values (fill) or zeros."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (layout.world,))
    placements = [Shard(layout.dim)]
    model = {}
    for index, (name, shape) in enumerate(tensor_shapes(total_bytes).items()):
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        local = block_values(index, shape[1], offset, local_shape) if fill else torch.zeros(local_shape)
        model[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=(shape[1], 1))
    return model


def mismatched(model: dict[str, Any], total_bytes: int) -> list[str]:
    """Names of the tensors whose local shard differs from the saved values in any element."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bad = []
    for index, (name, shape) in enumerate(tensor_shapes(total_bytes).items()):
        tensor = model[name]
        local_shape, offset = compute_local_shape_and_global_offset(shape, tensor.device_mesh, tensor.placements)
        if not torch.equal(tensor.to_local(), block_values(index, shape[1], offset, local_shape)):
            bad.append(name)
    return bad


def local_bytes(model: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in model.values())


def timed(run: Callable[[], Any]) -> tuple[Any, float]:
    """All ranks start `run` together (barrier); returns its result and this rank's seconds."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def rank_ckptd_save(spec: dict[str, Any], layout: Layout) -> dict[str, Any]:
    from ckptd.client import CheckpointClient

    model = build_model(spec["bytes"], layout, fill=True)
    with CheckpointClient(JOB, address=spec["address"], rank=spec["rank"], world_size=layout.world, on_error="raise", timeout_s=RANK_TIMEOUT_S) as ckpt:
        handle, seconds = timed(lambda: ckpt.save(STEP, {"model": model}))
        start = time.perf_counter()
        handle.wait_durable(timeout=RANK_TIMEOUT_S)
        durable = seconds + time.perf_counter() - start
    return {"stall_s": handle.stall_s, "durable_s": durable, "bytes_copied": handle.bytes_copied, "shard_bytes": local_bytes(model)}


def rank_ckptd_load(spec: dict[str, Any], layout: Layout) -> dict[str, Any]:
    from ckptd.client import CheckpointClient

    model = build_model(spec["bytes"], layout, fill=False)
    with CheckpointClient(JOB, address=spec["address"], rank=spec["rank"], world_size=layout.world, on_error="raise", timeout_s=RANK_TIMEOUT_S) as ckpt:
        step, seconds = timed(lambda: ckpt.load({"model": model}, step=STEP))
    return {"seconds": seconds, "step": step, "mismatched": mismatched(model, spec["bytes"])}


def rank_dcp_save(spec: dict[str, Any], layout: Layout) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model = build_model(spec["bytes"], layout, fill=True)
    _, seconds = timed(lambda: dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(spec["path"], sync_files=True)))
    return {"seconds": seconds, "shard_bytes": local_bytes(model)}


def rank_dcp_load(spec: dict[str, Any], layout: Layout) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model = build_model(spec["bytes"], layout, fill=False)
    _, seconds = timed(lambda: dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(spec["path"])))
    return {"seconds": seconds, "mismatched": mismatched(model, spec["bytes"])}


RANK_JOBS: dict[str, Callable[[dict[str, Any], Layout], dict[str, Any]]] = {
    "ckptd-save": rank_ckptd_save,
    "ckptd-load": rank_ckptd_load,
    "dcp-save": rank_dcp_save,
    "dcp-load": rank_dcp_load,
}


def rank_main(spec: dict[str, Any]) -> None:
    """One rank: join the gloo group, run spec["job"], write what it measured to OUT/RANK.json.

    spec: job (a RANK_JOBS key), bytes (state size), world, dim, rank, port, out, and per job
    address (ckptd) or path (DCP).
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    layout = Layout(spec["world"], spec["dim"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=spec["rank"],
        world_size=layout.world,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
    )
    try:
        result = RANK_JOBS[spec["job"]](spec, layout)
    finally:
        dist.destroy_process_group()
    Path(spec["out"], f"{spec['rank']}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------ running jobs of ranks


def run_ranks(spec: dict[str, Any], layout: Layout, jobdir: Path) -> list[dict[str, Any]]:
    """Start layout.world rank processes on `spec`, wait for all; returns each rank's result.

    Raises RuntimeError naming the rank and showing the end of its log when one fails (the
    others are then killed) or when the job takes longer than RANK_TIMEOUT_S.
    """
    jobdir.mkdir(parents=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(layout.world):
        rank_spec = {**spec, "world": layout.world, "dim": layout.dim, "rank": rank, "port": port, "out": str(jobdir)}
        with open(jobdir / f"rank{rank}.log", "wb") as log:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(rank_spec)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        wait_all(procs, jobdir)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads((jobdir / f"{rank}.json").read_text()) for rank in range(layout.world)]


def wait_all(procs: list[subprocess.Popen[bytes]], jobdir: Path) -> None:
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while any(p.poll() is None for p in procs):
        for rank, proc in enumerate(procs):
            if proc.poll() not in (None, 0):
                log = jobdir / f"rank{rank}.log"
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"rank {rank} of {jobdir.name} exited with {proc.returncode}; end of {log}:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{jobdir.name} did not finish within {RANK_TIMEOUT_S:.0f} s; rank logs in {jobdir}")
        time.sleep(0.1)
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            log = jobdir / f"rank{rank}.log"
            raise RuntimeError(f"rank {rank} of {jobdir.name} exited with {proc.returncode}; end of {log}:\n{log.read_text(errors='replace')[-3000:]}")


def check_restore(ranks: list[dict[str, Any]], what: str) -> float:
    """The slowest rank's load seconds; raises RuntimeError when any rank restored a wrong value."""
    bad = sorted({name for r in ranks for name in r["mismatched"]})
    if bad:
        raise RuntimeError(f"{what}: restored values differ from the saved ones in {len(bad)} tensor(s): {', '.join(bad[:5])}")
    steps = {r.get("step", STEP) for r in ranks}
    if steps != {STEP}:
        raise RuntimeError(f"{what}: load returned step(s) {sorted(steps)}, expected {STEP}")
    return max(r["seconds"] for r in ranks)


# ------------------------------------------------------------------ the systems under test


@dataclass
class Results:
    """What one run measured: timings keyed as in row_labels(), bytes per saving rank, notes, errors."""

    timings: dict[str, Timing] = field(default_factory=dict)
    bytes_copied: list[int] = field(default_factory=list)
    shard_bytes: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    node_bytes: list[int] = field(default_factory=list)  # per node, in the replicated save
    errors: dict[str, str] = field(default_factory=dict)  # what -> what went wrong
    cold: set[str] = field(default_factory=set)  # how the page cache was dropped


class Ckptd:
    """Saves through and restores from a real daemon; a cold restore is a new daemon's first load."""

    name = "ckptd"

    def __init__(self, workdir: Path, nbytes: int, results: Results) -> None:
        self.workdir, self.nbytes, self.results = workdir, nbytes, results
        self.rig = DaemonRig(root=workdir / "ckptd-root", logs=workdir)
        self.starts: list[float] = []

    def save(self) -> None:
        self.rig.start()
        ranks = run_ranks({"job": "ckptd-save", "bytes": self.nbytes, "address": self.rig.address}, SAVE_LAYOUT, self.workdir / "ckptd-save")
        self.results.timings["ckptd.save.stall"] = Timing((max(r["stall_s"] for r in ranks),), self.nbytes)
        self.results.timings["ckptd.save.durable"] = Timing((max(r["durable_s"] for r in ranks),), self.nbytes)
        self.results.bytes_copied = [r["bytes_copied"] for r in ranks]
        self.results.shard_bytes = [r["shard_bytes"] for r in ranks]

    def cold_load(self, layout: Layout, tag: str) -> float:
        self.rig.stop()
        self.results.cold.add(drop_page_cache(files_under(self.rig.root)))
        start = time.perf_counter()
        self.rig.start()
        self.starts.append(time.perf_counter() - start)
        if newest_in_memory(self.rig.address):
            self.results.notes.append("ckptd: a new daemon reported the step in memory: its restore was not from disk")
        ranks = run_ranks({"job": "ckptd-load", "bytes": self.nbytes, "address": self.rig.address}, layout, self.workdir / tag)
        return check_restore(ranks, f"ckptd {layout.label}")

    def close(self) -> None:
        if self.starts:
            self.results.timings["ckptd.daemon_start"] = Timing(tuple(self.starts), 0)
        self.rig.close()


class Dcp:
    """dcp.save with FileSystemWriter (fsync) and dcp.load with FileSystemReader, same disk."""

    name = "dcp"

    def __init__(self, workdir: Path, nbytes: int, results: Results) -> None:
        self.workdir, self.nbytes, self.results = workdir, nbytes, results
        self.path = workdir / "dcp-ckpt"

    def save(self) -> None:
        os.sync()
        ranks = run_ranks({"job": "dcp-save", "bytes": self.nbytes, "path": str(self.path)}, SAVE_LAYOUT, self.workdir / "dcp-save")
        self.results.timings["dcp.save"] = Timing((max(r["seconds"] for r in ranks),), self.nbytes)

    def cold_load(self, layout: Layout, tag: str) -> float:
        self.results.cold.add(drop_page_cache(files_under(self.path)))
        ranks = run_ranks({"job": "dcp-load", "bytes": self.nbytes, "path": str(self.path)}, layout, self.workdir / tag)
        return check_restore(ranks, f"DCP {layout.label}")

    def close(self) -> None:
        return None


def run_parts(parts: list[str], workdir: Path, nbytes: int, reps: int, results: Results) -> None:
    """Save with each system, then `reps` rounds of cold restores, the systems and layouts
    interleaved so that drift in the disk's speed hits both alike. A failure is recorded and
    the rest still runs; a system whose save failed is not restored from."""
    if "nodes" in parts:
        print("nodes: replicated save by 4 ranks on 2 daemons ...", flush=True)
        attempt(results, "nodes", lambda: replicated_node_bytes(workdir, tensor_shapes(nbytes), results))
    systems = [cls(workdir, nbytes, results) for cls in (Ckptd, Dcp) if cls.name in parts]
    try:
        ready = []
        for system in systems:
            print(f"{system.name}: save, {SAVE_LAYOUT.label} ...", flush=True)
            if attempt(results, f"{system.name} save", system.save):
                ready.append(system)
        times: dict[str, list[float]] = {}
        for rep in range(reps):
            for layout in LOAD_LAYOUTS:
                for system in ready:
                    key = f"{system.name}.load.{layout.key}"
                    if key in results.errors:
                        continue
                    print(f"rep {rep + 1}/{reps}: {system.name} cold restore, {layout.label} ...", flush=True)
                    tag = f"{system.name}-load-{layout.key}-{rep}"
                    seconds: list[float] = []
                    if attempt(results, key, lambda: seconds.append(system.cold_load(layout, tag))):
                        times.setdefault(key, []).extend(seconds)
        for key, values in times.items():
            results.timings[key] = Timing(tuple(values), nbytes)
    finally:
        for system in systems:
            system.close()


def replicated_node_bytes(workdir: Path, shapes: dict[str, tuple[int, int]], results: Results) -> None:
    """2 daemons that know each other, 4 ranks (2 per node) saving one replicated state: the
    bytes of data files in each node's root."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptd.client import CheckpointClient
    from ckptd.demo.process import start_daemon

    token = os.urandom(16).hex()
    peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    base = Path(tempfile.mkdtemp(prefix="ckptd-nodes-", dir="/tmp"))
    daemons = []
    try:
        for node in range(2):
            shm = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
            daemons.append((shm, start_daemon(
                root=workdir / f"nodes-root-{node}", socket=base / f"n{node}.sock",
                extra_args=["--shm-dir", str(shm), "--node-rank", str(node), "--peers", peers],
                env={**os.environ, "CKPTD_PEER_TOKEN": token}, log_path=workdir / f"nodes-daemon-{node}.log",
            )))
        state = {"model": {name: torch.full(shape, float(i)) for i, (name, shape) in enumerate(shapes.items())}}

        def rank_saves(rank: int) -> None:
            with CheckpointClient(JOB, address=daemons[rank // 2][1].address, rank=rank, world_size=4,
                                  local_world_size=2, on_error="raise", timeout_s=RANK_TIMEOUT_S) as ckpt:
                ckpt.save(STEP, state).wait_durable(timeout=RANK_TIMEOUT_S)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(rank_saves, range(4)))
        for node in range(2):
            step_dir = workdir / f"nodes-root-{node}" / JOB / f"step-{STEP:08d}"
            results.node_bytes.append(sum(p.stat().st_size for p in step_dir.glob("*.safetensors")))
    finally:
        for shm, daemon in daemons:
            daemon.stop()
            shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def attempt(results: Results, what: str, run: Callable[[], Any]) -> bool:
    """Run; a failure is recorded under `what` and printed. Returns whether it succeeded."""
    try:
        run()
        return True
    except Exception as exc:
        results.errors[what] = f"{type(exc).__name__}: {exc}"
        print(f"  {what} FAILED: {results.errors[what]}", flush=True)
        return False


# ------------------------------------------------------------------ report


def row_labels() -> dict[str, str]:
    """Timing key -> label, in print order."""
    rows = {
        "ckptd.save.stall": f"ckptd save, {SAVE_LAYOUT.label}: stall (slowest rank)",
        "ckptd.save.durable": f"ckptd save, {SAVE_LAYOUT.label}: durable",
        "dcp.save": f"DCP save, {SAVE_LAYOUT.label} (fsync)",
        "ckptd.daemon_start": "ckptd daemon start (until healthy)",
    }
    for system, name in (("ckptd", "ckptd"), ("dcp", "DCP")):
        for layout in LOAD_LAYOUTS:
            kind = "same layout" if layout == SAME else "resharded"
            rows[f"{system}.load.{layout.key}"] = f"{name} restore cold, {layout.label} ({kind})"
    return rows


def format_table(results: Results) -> list[str]:
    lines = [f"{'measurement':<50} {'s':>8}  {'[min - max]':<19} {'GB/s':>6}  n"]
    for key, label in row_labels().items():
        t = results.timings.get(key)
        if t is None:
            continue
        spread = f"[{t.best:.3f} - {t.worst:.3f}]" if len(t.times) > 1 else ""
        rate = f"{t.nbytes / t.median / 1e9:6.2f}" if t.nbytes and t.median > 0 else "     -"
        lines.append(f"{label:<50} {t.median:8.3f}  {spread:<19} {rate}  {len(t.times)}")
    return lines


@dataclass(frozen=True)
class Ratio:
    """timings[num].median / timings[den].median; PASS when <= limit, no verdict when limit is None."""

    label: str
    num: str
    den: str
    limit: float | None = None


RATIOS: tuple[Ratio, ...] = (
    *(Ratio(f"ckptd {x.label} / ckptd same layout", f"ckptd.load.{x.key}", f"ckptd.load.{SAME.key}", RESHARD_LIMIT) for x in RESHARDED),
    *(Ratio(f"ckptd / DCP, {x.label}", f"ckptd.load.{x.key}", f"dcp.load.{x.key}") for x in LOAD_LAYOUTS),
    *(Ratio(f"DCP {x.label} / DCP same layout", f"dcp.load.{x.key}", f"dcp.load.{SAME.key}") for x in RESHARDED),
)


def ratio_value(results: Results, ratio: Ratio) -> float | None:
    num, den = results.timings.get(ratio.num), results.timings.get(ratio.den)
    return None if num is None or den is None or den.median <= 0 else num.median / den.median


def format_ratios(results: Results) -> list[str]:
    lines = []
    for r in RATIOS:
        value = ratio_value(results, r)
        target = f"target <= {r.limit}" if r.limit is not None else "(no target)"
        if value is None:
            lines.append(f"{r.label:<44} n/a (needs {r.num} and {r.den}; not run or failed)   {target}")
            continue
        flag = "" if r.limit is None else ("PASS" if value <= r.limit else "FAIL")
        num, den = results.timings[r.num].median, results.timings[r.den].median
        lines.append(f"{r.label:<44} {num:.3f} s / {den:.3f} s = {value:5.2f}   {target} {flag}".rstrip())
    return lines


def format_bytes(results: Results) -> list[str]:
    copied, shards = results.bytes_copied, results.shard_bytes
    if not copied:
        lines = ["bytes handed over per rank in the 4-rank ckptd save: n/a (the ckptd save did not run)"]
    else:
        mean = statistics.mean(copied)
        exact = "yes" if copied == shards else f"NO (shards: {shards})"
        lines = [
            f"bytes handed over per rank in the 4-rank ckptd save: max / mean = {max(copied) / mean:.3f} "
            f"(max {max(copied):,}, mean {mean:,.0f}; per rank {copied}; each rank exactly its own shard: {exact})"
        ]
    nodes = results.node_bytes
    if not nodes:
        lines.append("bytes written per node in a replicated save: n/a (the nodes part did not run)")
    else:
        spread = max(nodes) / statistics.mean(nodes)
        flag = "PASS" if spread <= NODE_LIMIT else "FAIL"
        lines.append(
            f"bytes written per node in a replicated save (4 ranks on 2 daemons): max / mean = {spread:.3f}   "
            f"target <= {NODE_LIMIT} {flag} (per node {nodes})"
        )
    return lines


def summary_json(machine: dict[str, Any], shapes: dict[str, tuple[int, int]], reps: int, results: Results) -> dict[str, Any]:
    return {
        "machine": machine,
        "state": {"bytes": shapes_bytes(shapes), "tensors": len(shapes), "shapes": shapes},
        "reps": reps,
        "page_cache": sorted(results.cold),
        "timings": {k: {"times_s": list(t.times), "median_s": t.median, "bytes": t.nbytes} for k, t in results.timings.items()},
        "ratios": [{"ratio": r.label, "value": ratio_value(results, r), "limit": r.limit} for r in RATIOS],
        "bytes_copied": results.bytes_copied,
        "shard_bytes": results.shard_bytes,
        "node_bytes": results.node_bytes,
        "notes": results.notes,
        "errors": results.errors,
    }


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="size of the state in GiB (default: 1)")
    p.add_argument("--reps", type=int, default=3, help="cold restores per system and layout (default: 3)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on the disk under test, not a tmpfs (default: ./bench-out)")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated systems to run, of {','.join(PARTS)} (default: all)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and logs under --out (kept anyway when something fails)")
    p.add_argument("--json", action="store_true", help="also print a JSON summary at the end")
    p.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)  # a rank process; see rank_main
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"--only: unknown part(s) {', '.join(unknown)}; use some of {', '.join(PARTS)}")
    if args.size_gib <= 0 or args.reps < 1:
        p.error("--size-gib must be > 0 and --reps >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        rank_main(json.loads(args.worker))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="reshard-", dir=args.out.resolve()))
    machine = machine_info(workdir)
    shapes = tensor_shapes(int(args.size_gib * GIB))
    nbytes = shapes_bytes(shapes)
    rows = sorted({r for r, _ in shapes.values()})
    header = [
        "ckptd resharded restore benchmark (tests/bench/bench_reshard.py)",
        f"machine: {machine['cores']} cores ({machine['usable_cores']} usable), {machine['ram_gib']} GiB RAM, {machine['kernel']}",
        f"software: Python {machine['python']}, torch {machine['torch']}; ranks: processes, gloo on 127.0.0.1, 1 torch thread each",
        f"state: {len(shapes)} fp32 2-D tensors, {nbytes:,} bytes ({nbytes / GIB:.2f} GiB), DTensors on a 1-D cpu mesh; "
        f"row counts {', '.join(map(str, rows))} (none divisible by 3 or 4)",
        f"saved by {SAVE_LAYOUT.label}; restored cold into {', '.join(x.label for x in LOAD_LAYOUTS)}",
        f"scratch: {workdir} ({machine['out_fs']})   reps: {args.reps}   parts: {','.join(args.parts)}",
        f"load average at start: {load_average()}",
    ]
    print("\n".join(header), flush=True)
    if machine["out_fs"] in ("tmpfs", "ramfs"):
        print("warning: --out is in memory, not on a disk: the cold figures are not disk figures", flush=True)

    results = Results()
    start = time.perf_counter()
    run_parts(args.parts, workdir, nbytes, args.reps, results)
    if not results.errors:
        results.notes.append("every restore was checked element by element against the saved values and matched")
    if args.keep or results.errors:
        results.notes.append(f"kept {workdir} (checkpoints, daemon and rank logs)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)

    cold = ", ".join(sorted(results.cold)) or "not needed"
    print()
    print("\n".join(header))
    print(f"load average at end:   {load_average()}  (other work on the machine skews the figures: compare min - max)")
    print(f"run took {time.perf_counter() - start:.0f} s")
    print(f"timings: seconds, median of {args.reps} (saves: 1); a restore is the slowest rank's load; "
          f"GB/s = 1e9 bytes/s of the whole state; cold = page cache dropped by {cold}")
    print()
    print("\n".join(format_table(results)))
    print()
    print("ratios (medians):")
    print("\n".join(format_ratios(results)))
    print("\n".join(format_bytes(results)))
    if "none" in results.cold:
        print("warning: the page cache could NOT be dropped: the 'cold' restores were not cold")
    for note in dict.fromkeys(results.notes):
        print(f"note: {note}")
    for what, error in results.errors.items():
        print(f"ERROR in {what}: {error}")
    if args.json:
        print()
        print(json.dumps(summary_json(machine, shapes, args.reps, results), indent=2))
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
