"""Save and restore benchmark: ckptd against the machine's floors and DCP's fastest async save.

One run measures, on one state of `--size-gib` fp32 tensors (a small transformer's weights plus
AdamW's exp_avg and exp_avg_sq, the same state for every part):

- floors: a flat memcpy of the same bytes into a reused buffer; write + fsync of the bytes to one
  file; a cold read of that file after dropping the page cache;
- dcp: torch.distributed.checkpoint.async_save with the PROCESS executor and a reused
  DefaultStager (shared memory, async staging): blocked, staged, total (durable);
- ckptd: a real daemon; stall and durable time of save(), restore from the daemon's memory,
  and restore from disk after a daemon restart with the page cache dropped;
- paired (when dcp runs too): one DCP async_save right before each timed ckptd save, and one
  memcpy right before each memory restore, so those targets also compare figures taken under
  the same load (the parts run minutes apart on a shared machine).

It prints a table of times and GB/s, then each target ratio with PASS or FAIL. See
tests/bench/README.md. Run as root for real cold reads (drop_caches). Exits 0 whether targets
pass or fail; 1 only if a part could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

GIB = 2**30
CHUNK = 64 * 2**20  # bytes per os.write / readinto call in the floors
PARTS = ("floors", "dcp", "ckptd")
LAYERS = 4
JOB = "bench"
# Steady state starts after 5 saves: the first into each of the 2 arena sets (--max-inflight)
# plans and maps new memory, and until keep_last=3 steps exist retention has deleted nothing, so
# the files go to blocks never written before (3-5x slower on thin-provisioned disks) instead of
# overwriting a deleted step's recycled files.
WARMUP_SAVES = 5

State = dict[str, Any]


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one measurement: seconds per repetition, bytes moved per repetition."""

    times: tuple[float, ...]
    nbytes: int

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def worst(self) -> float:
        return max(self.times)

    def stat(self, which: str) -> float:
        """`which` is "median" or "best"."""
        return self.best if which == "best" else self.median


@dataclass
class Results:
    """Everything one run measured, keyed as in ROWS, plus notes for the reader."""

    timings: dict[str, Timing] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # part -> what went wrong
    cold: set[str] = field(default_factory=set)  # how the page cache was dropped: drop_caches, fadvise, none


# key -> label, in print order. "best" rows report the best repetition, all others the median.
ROWS: dict[str, str] = {
    "floor.memcpy.numpy": "floor: memcpy, numpy copyto (1 thread)",
    "floor.memcpy.torch": "floor: memcpy, torch copy_ (intra-op threads)",
    "floor.memcpy": "floor: memcpy (the faster of the two) [best]",
    "floor.write_fsync": "floor: write + fsync, one file",
    "floor.read_cold": "floor: read one file, cold",
    "floor.read_cold_beside": "floor: read one file, cold, before each ckptd cold restore",
    "dcp.first_total": "DCP first call (spawns its process): total",
    "dcp.blocked": "DCP async_save: blocked",
    "dcp.staged": "DCP async_save: staged (state reusable)",
    "dcp.total": "DCP async_save: total (durable)",
    "dcp.staged_beside": "DCP async_save: staged, right before each ckptd save",
    "dcp.total_beside": "DCP async_save: total, right before each ckptd save",
    "floor.memcpy_beside": "floor: memcpy (torch), right before each memory restore",
    "ckptd.warmup_stall": "ckptd warm-up saves (new arenas, new blocks): stall",
    "ckptd.warmup_durable": "ckptd warm-up saves (new arenas, new blocks): durable",
    "ckptd.stall": "ckptd save: stall (handle.stall_s)",
    "ckptd.save_wall": "ckptd save: wall time of save()",
    "ckptd.durable": "ckptd save: durable (save() to wait_durable)",
    "ckptd.restore_memory_same_client": "ckptd restore from memory, saving client",
    "ckptd.restore_memory": "ckptd restore from memory, new client",
    "ckptd.daemon_start": "ckptd daemon start (until healthy)",
    "ckptd.restore_cold": "ckptd restore from disk, cold, new daemon",
}
BEST_ROWS = {"floor.memcpy"}


@dataclass(frozen=True)
class Target:
    """PASS when timings[num] / timings[den] <= limit (each taken as its stat: median or best)."""

    label: str
    num: str
    den: str
    limit: float
    den_stat: str = "median"


TARGETS: tuple[Target, ...] = (
    Target("stall / DCP staged", "ckptd.stall", "dcp.staged", 1.0),
    Target("stall / DCP staged, paired", "ckptd.stall", "dcp.staged_beside", 1.0),
    Target("durable / DCP total", "ckptd.durable", "dcp.total", 0.5),
    Target("durable / DCP total, paired", "ckptd.durable", "dcp.total_beside", 0.5),
    Target("durable / write+fsync floor", "ckptd.durable", "floor.write_fsync", 1.3),
    Target("restore from memory / memcpy floor", "ckptd.restore_memory", "floor.memcpy", 2.0, den_stat="best"),
    Target("restore from memory / memcpy, paired", "ckptd.restore_memory", "floor.memcpy_beside", 2.0),
    Target("restore cold / cold-read floor", "ckptd.restore_cold", "floor.read_cold_beside", 1.3),
)


# ------------------------------------------------------------------ the state


@dataclass(frozen=True)
class Shape:
    """The transformer the state is shaped after: hidden size, vocabulary, layers."""

    hidden: int
    vocab: int
    layers: int


def shape_for(total_bytes: int, layers: int = LAYERS) -> Shape:
    """A model whose fp32 weights + exp_avg + exp_avg_sq come close to (not over) total_bytes.

    Hidden size: a multiple of 64 with the embedding about 16x hidden rows; the vocabulary then
    takes up the rest.
    """
    params = total_bytes // (4 * 3)
    hidden = max(64, int(math.sqrt(params / (32 + 12 * layers))) // 64 * 64)
    per_layer = 12 * hidden * hidden + 2 * hidden
    vocab = max(1, (params - layers * per_layer - hidden) // (2 * hidden))
    return Shape(hidden, vocab, layers)


def model_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape: embedding, per layer fused qkv, out, mlp up/down, two norms; final norm, lm_head."""
    h, v = shape.hidden, shape.vocab
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(shape.layers):
        p = f"layers.{i}."
        shapes[p + "attn.qkv.weight"] = (3 * h, h)
        shapes[p + "attn.out.weight"] = (h, h)
        shapes[p + "mlp.up.weight"] = (4 * h, h)
        shapes[p + "mlp.down.weight"] = (h, 4 * h)
        shapes[p + "norm1.weight"] = (h,)
        shapes[p + "norm2.weight"] = (h,)
    shapes["norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def make_state(shape: Shape, seed: int = 0) -> State:
    """{"model": {name: weight}, "optimizer": {"state": {name: {"exp_avg", "exp_avg_sq"}}}}, random fp32."""
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, dims in model_shapes(shape).items():
        model[name] = torch.randn(dims, generator=gen) * 0.02
        optim[name] = {
            "exp_avg": torch.randn(dims, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(dims, generator=gen) * 1e-6,
        }
    return {"model": model, "optimizer": {"state": optim}}


def tensors(state: State) -> Iterator[torch.Tensor]:
    """Every tensor of the state, in a fixed order."""
    yield from state["model"].values()
    for moments in state["optimizer"]["state"].values():
        yield from moments.values()


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def sample_sums(state: State) -> list[float]:
    """A cheap fingerprint of the values: the sum of every 1021st element of each tensor."""
    return [float(t.view(-1)[::1021].double().sum()) for t in tensors(state)]


def zero_state(state: State) -> None:
    """Overwrite the values so that a restore must really write them back."""
    for t in tensors(state):
        t.zero_()


def flat_copy(state: State) -> torch.Tensor:
    """The state's bytes, back to back, in one new uint8 tensor (the floors' source)."""
    flat = torch.empty(state_bytes(state), dtype=torch.uint8)
    offset = 0
    for t in tensors(state):
        raw = t.view(-1).view(torch.uint8)
        flat[offset : offset + raw.numel()].copy_(raw)
        offset += raw.numel()
    return flat


# ------------------------------------------------------------------ machine and page cache


def machine_info(out: Path) -> dict[str, Any]:
    """What the numbers depend on: cores, RAM, kernel, versions, the file system of `out`."""
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "ram_gib": round(mem_kib / 2**20, 1),
        "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "out": str(out),
        "out_fs": fs_type(out),
    }


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: how busy the machine was around the measurements."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fs_type(path: Path) -> str:
    """The type of the file system holding `path`, from /proc/mounts (longest matching mount point)."""
    best, kind = "", "unknown"
    real = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, fields[2]
    return kind


def drop_page_cache(files: list[Path]) -> str:
    """Make the next reads of `files` come from the disk; returns how: drop_caches, fadvise or none.

    drop_caches needs root. The fallback, POSIX_FADV_DONTNEED, evicts only clean pages of these
    files, so everything is synced first.
    """
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError as exc:
        print(f"  note: drop_caches refused ({exc}); evicting the files with posix_fadvise instead", flush=True)
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"
    except OSError as exc:
        print(f"  warning: could not drop the page cache ({exc}); 'cold' reads are not cold", flush=True)
        return "none"


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# ------------------------------------------------------------------ floors


def time_reps(reps: int, once: Callable[[], None], before: Callable[[], None] | None = None) -> tuple[float, ...]:
    """Seconds of `once()` for each of `reps` repetitions; `before()` runs untimed ahead of each."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return tuple(times)


def floor_memcpy(src: torch.Tensor, dst: torch.Tensor, reps: int, results: Results) -> None:
    """One flat copy into a pre-faulted, reused buffer; after a warm-up copy, numpy and torch."""
    nbytes = src.numel()
    src_np, dst_np = src.numpy(), dst.numpy()
    np.copyto(dst_np, src_np)  # warm-up: faults dst in
    results.timings["floor.memcpy.numpy"] = Timing(time_reps(reps, lambda: np.copyto(dst_np, src_np)), nbytes)
    dst.copy_(src)
    results.timings["floor.memcpy.torch"] = Timing(time_reps(reps, lambda: dst.copy_(src)), nbytes)
    faster = min(("floor.memcpy.numpy", "floor.memcpy.torch"), key=lambda k: results.timings[k].best)
    results.timings["floor.memcpy"] = results.timings[faster]
    results.notes.append(f"memcpy floor = {ROWS[faster].removeprefix('floor: ')}, best of {reps} after a warm-up")


def write_fsync(buf: np.ndarray, path: Path) -> None:
    """Write `buf` to a new file in CHUNK-sized os.write calls, then fsync it."""
    view = memoryview(buf).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        while offset < len(view):
            offset += os.write(fd, view[offset : offset + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_into(path: Path, buf: np.ndarray) -> None:
    """Read the file into `buf` (already faulted in) in CHUNK-sized readinto calls."""
    view = memoryview(buf).cast("B")
    with open(path, "rb", buffering=0) as f:
        offset = 0
        while offset < len(view):
            got = f.readinto(view[offset : offset + CHUNK])
            if not got:
                raise EOFError(f"{path} is shorter than {len(view)} bytes")
            offset += got


def floor_disk(src: torch.Tensor, dst: torch.Tensor, workdir: Path, reps: int, results: Results) -> None:
    """write + fsync of the bytes to a fresh file per repetition; then cold reads of the last one."""
    path = workdir / "floor.bin"
    src_np, dst_np = src.numpy(), dst.numpy()

    def fresh_file() -> None:
        path.unlink(missing_ok=True)
        os.sync()

    results.timings["floor.write_fsync"] = Timing(time_reps(reps, lambda: write_fsync(src_np, path), fresh_file), src.numel())
    results.timings["floor.read_cold"] = Timing(
        time_reps(reps, lambda: read_into(path, dst_np), lambda: results.cold.add(drop_page_cache([path]))), src.numel()
    )
    if not np.array_equal(src_np[::4099], dst_np[::4099]):
        raise RuntimeError(f"the cold read of {path} returned other bytes than were written")
    path.unlink()


def bench_floors(state: State, workdir: Path, reps: int, results: Results) -> None:
    """memcpy, write + fsync and cold-read floors on a flat copy of the state's bytes."""
    src = flat_copy(state)
    dst = torch.empty_like(src)
    try:
        floor_memcpy(src, dst, reps, results)
        floor_disk(src, dst, workdir, reps, results)
    finally:
        del src, dst
        gc.collect()


# ------------------------------------------------------------------ DCP


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dcp_save_once(state: State, path: Path, stager: Any) -> tuple[float, float, float]:
    """One async_save to a new directory; returns seconds until (returned, staged, durable)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    start = time.perf_counter()
    response = dcp.async_save(
        state,
        storage_writer=dcp.FileSystemWriter(path, sync_files=True),  # the default; stated for clarity
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=stager,
    )
    blocked = time.perf_counter() - start
    if not isinstance(response, AsyncSaveResponse):
        raise RuntimeError(f"async_save returned {type(response).__name__}, not AsyncSaveResponse: is staging async?")
    response.staging_completion.result()
    staged = time.perf_counter() - start
    response.upload_completion.result()
    return blocked, staged, time.perf_counter() - start


def stop_dcp_process() -> None:
    """End the checkpoint process that the PROCESS executor keeps for the life of the trainer.

    DCP holds it in a private module global and ends it only at exit; dropping it here frees its
    memory before the next part. Its __del__ sends TERMINATE and joins (SIGTERM after 5 s).
    """
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if process is not None:
        executor._CHECKPOINT_PROCESS = None
        process.__del__()


@contextlib.contextmanager
def dcp_session(state: State, workdir: Path) -> Iterator[Callable[[str], tuple[float, float, float]]]:
    """DCP's fastest CPU set-up, warmed up (the first call spawns its process and is not timed);
    yields save(name) -> (blocked, staged, total) seconds of one async_save of `state` to a new
    directory `workdir/name`, which is removed afterwards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # The PROCESS executor's child builds its own gloo group at MASTER_ADDR (else the host's FQDN).
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        stager = DefaultStager(
            StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False)
        )

        def save(name: str) -> tuple[float, float, float]:
            os.sync()
            try:
                return dcp_save_once(state, workdir / name, stager)
            finally:
                shutil.rmtree(workdir / name, ignore_errors=True)

        try:
            save("dcp-warmup")
            yield save
        finally:
            stager.close()
            stop_dcp_process()
    finally:
        dist.destroy_process_group()
        gc.collect()


def bench_dcp(state: State, workdir: Path, reps: int, results: Results) -> None:
    """`reps` saves after a warm-up call that spawns DCP's process, each to a new directory."""
    nbytes = state_bytes(state)
    start = time.perf_counter()
    with dcp_session(state, workdir) as save:
        results.timings["dcp.first_total"] = Timing((time.perf_counter() - start,), nbytes)
        runs = [save(f"dcp-{i}") for i in range(reps)]
    for j, key in enumerate(("dcp.blocked", "dcp.staged", "dcp.total")):
        results.timings[key] = Timing(tuple(r[j] for r in runs), nbytes)


# ------------------------------------------------------------------ ckptd


@dataclass
class DaemonRig:
    """Runs one ckptd daemon at a time on one root, with a short socket path and a private arena directory."""

    root: Path
    logs: Path
    sock_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/tmp")))
    shm_parent: Path = Path("/dev/shm")
    shm_dir: Path = field(init=False)
    daemon: Any = None  # the running ckptd.demo.process.DaemonProcess, if any
    started: int = 0

    def __post_init__(self) -> None:
        self.shm_dir = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir=self.shm_parent))

    @property
    def address(self) -> str:
        return str(self.daemon.address)

    def start(self) -> None:
        """Start a daemon (stopping the previous one first); returns once it answers its health check."""
        from ckptd.demo.process import start_daemon

        self.stop()
        self.started += 1
        self.daemon = start_daemon(
            root=self.root,
            socket=self.sock_dir / "d.sock",
            extra_args=["--shm-dir", str(self.shm_dir)],
            log_path=self.logs / f"ckptd-daemon-{self.started}.log",
        )

    def stop(self) -> None:
        """SIGTERM the running daemon, if any, and wait for it."""
        if self.daemon is not None:
            daemon, self.daemon = self.daemon, None
            daemon.stop()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
            shutil.rmtree(self.shm_dir, ignore_errors=True)


def client_for(address: str) -> Any:
    from ckptd.client import CheckpointClient

    return CheckpointClient(job=JOB, address=address, rank=0, world_size=1, on_error="raise")


def ckptd_saves(client: Any, state: State, reps: int, results: Results, beside: Callable[[], None] | None = None) -> int:
    """Warm-up saves, then `reps` timed saves, each waited until durable; returns the last step.

    See WARMUP_SAVES for why steady state starts after them. `beside()` runs (and records its
    own timings) right before each timed save.
    """
    nbytes = state_bytes(state)
    warm_stall, warm_durable = [], []
    for step in range(WARMUP_SAVES):
        start = time.perf_counter()
        handle = client.save(step, state)
        handle.wait_durable()
        warm_durable.append(time.perf_counter() - start)
        warm_stall.append(handle.stall_s)
    results.timings["ckptd.warmup_stall"] = Timing(tuple(warm_stall), nbytes)
    results.timings["ckptd.warmup_durable"] = Timing(tuple(warm_durable), nbytes)
    stall, wall, durable = [], [], []
    last = WARMUP_SAVES + reps - 1
    for step in range(WARMUP_SAVES, last + 1):
        if beside is not None:
            beside()
        os.sync()
        start = time.perf_counter()
        handle = client.save(step, state)
        wall.append(time.perf_counter() - start)
        handle.wait_durable()
        durable.append(time.perf_counter() - start)
        stall.append(handle.stall_s)
    results.timings["ckptd.stall"] = Timing(tuple(stall), nbytes)
    results.timings["ckptd.save_wall"] = Timing(tuple(wall), nbytes)
    results.timings["ckptd.durable"] = Timing(tuple(durable), nbytes)
    return last


def timed_load(client: Any, state: State, expected_step: int, expected: list[float]) -> float:
    """Zero the state, then time `client.load(state)` of the newest step; returns seconds.

    Raises RuntimeError when the step or the values that come back are not what was saved.
    """
    zero_state(state)
    start = time.perf_counter()
    step = client.load(state)
    seconds = time.perf_counter() - start
    if step != expected_step:
        raise RuntimeError(f"load returned step {step}, expected {expected_step}")
    if sample_sums(state) != expected:
        raise RuntimeError("the restored values differ from the saved ones")
    return seconds


def timed_fresh_load(address: str, state: State, expected_step: int, expected: list[float]) -> float:
    """timed_load with a new client, as a restarted trainer has: it maps the arenas anew."""
    with client_for(address) as client:
        return timed_load(client, state, expected_step, expected)


def newest_in_memory(address: str) -> bool:
    """Whether the daemon says it still holds the job's newest step in memory."""
    with client_for(address) as client:
        return bool(client.list()[-1].in_memory)


def bench_ckptd(
    state: State, workdir: Path, reps: int, results: Results, shm_parent: Path = Path("/dev/shm"), paired: bool = True
) -> None:
    """Saves, restores from the daemon's memory, and cold restores from disk by a new daemon.

    paired: each timed save follows one DCP async_save and each memory restore one memcpy of
    the same bytes, so the targets compare figures taken under the same load (this machine is
    shared: load shifts between parts run minutes apart)."""
    rig = DaemonRig(root=workdir / "ckptd-root", logs=workdir, shm_parent=shm_parent)
    try:
        rig.start()
        with contextlib.ExitStack() as stack:
            dcp_save = stack.enter_context(dcp_session(state, workdir)) if paired else None
            ckptd_save_and_restore(rig, state, reps, results, dcp_save)
    finally:
        rig.close()
        gc.collect()


def ckptd_save_and_restore(
    rig: DaemonRig, state: State, reps: int, results: Results, dcp_save: Callable[[str], tuple[float, float, float]] | None = None
) -> None:
    nbytes = state_bytes(state)
    expected = sample_sums(state)
    dcp_runs: list[tuple[float, float, float]] = []
    beside = None if dcp_save is None else lambda: dcp_runs.append(dcp_save(f"dcp-beside-{len(dcp_runs)}"))
    with client_for(rig.address) as client:
        step = ckptd_saves(client, state, reps, results, beside)
        if not newest_in_memory(rig.address):
            results.notes.append("ckptd: the newest snapshot was NOT in the daemon's memory at the memory restore")
        same = [timed_load(client, state, step, expected) for _ in range(reps)]
    if dcp_runs:
        results.timings["dcp.staged_beside"] = Timing(tuple(r[1] for r in dcp_runs), nbytes)
        results.timings["dcp.total_beside"] = Timing(tuple(r[2] for r in dcp_runs), nbytes)
    results.timings["ckptd.restore_memory_same_client"] = Timing(tuple(same), nbytes)
    src = flat_copy(state)
    dst = torch.empty_like(src)
    dst.copy_(src)  # faults dst in
    memory, memcpy = [], []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        memcpy.append(time.perf_counter() - start)
        memory.append(timed_fresh_load(rig.address, state, step, expected))
    del src, dst
    results.timings["floor.memcpy_beside"] = Timing(tuple(memcpy), nbytes)
    results.timings["ckptd.restore_memory"] = Timing(tuple(memory), nbytes)
    # The disk's read speed drifts a lot on a shared machine: a cold read of a plain file of the
    # same size right before each cold restore gives the floor under the same conditions.
    floor_file = rig.root.parent / "floor-beside.bin"
    flat = flat_copy(state).view(torch.uint8).numpy()
    write_fsync(flat, floor_file)
    starts, cold, floor = [], [], []
    for _ in range(reps):
        rig.stop()
        results.cold.add(drop_page_cache([floor_file]))
        start = time.perf_counter()
        read_into(floor_file, flat)
        floor.append(time.perf_counter() - start)
        results.cold.add(drop_page_cache(files_under(rig.root)))
        start = time.perf_counter()
        rig.start()
        starts.append(time.perf_counter() - start)
        if newest_in_memory(rig.address):
            results.notes.append("ckptd: a new daemon reported the snapshot in memory: the cold restore is not from disk")
        cold.append(timed_fresh_load(rig.address, state, step, expected))
    results.timings["ckptd.daemon_start"] = Timing(tuple(starts), 0)
    results.timings["ckptd.restore_cold"] = Timing(tuple(cold), nbytes)
    results.timings["floor.read_cold_beside"] = Timing(tuple(floor), nbytes)
    floor_file.unlink()
    results.notes.append("ckptd: every restore was checked against the saved values (sampled) and matched")


# ------------------------------------------------------------------ report


def gbps(timing: Timing, seconds: float) -> str:
    return f"{timing.nbytes / seconds / 1e9:6.2f}" if timing.nbytes and seconds > 0 else "     -"


def format_table(results: Results) -> list[str]:
    lines = [f"{'measurement':<50} {'s':>8}  {'[min - max]':<19} {'GB/s':>6}  n"]
    for key, label in ROWS.items():
        t = results.timings.get(key)
        if t is None:
            continue
        shown = t.best if key in BEST_ROWS else t.median
        spread = f"[{t.best:.3f} - {t.worst:.3f}]" if len(t.times) > 1 else ""
        lines.append(f"{label:<50} {shown:8.3f}  {spread:<19} {gbps(t, shown)}  {len(t.times)}")
    return lines


@dataclass(frozen=True)
class Verdict:
    target: Target
    num_s: float | None
    den_s: float | None

    @property
    def ratio(self) -> float | None:
        if self.num_s is None or self.den_s is None or self.den_s <= 0:
            return None
        return self.num_s / self.den_s

    @property
    def passed(self) -> bool | None:
        return None if self.ratio is None else self.ratio <= self.target.limit


def verdicts(results: Results) -> list[Verdict]:
    out = []
    for target in TARGETS:
        num, den = results.timings.get(target.num), results.timings.get(target.den)
        out.append(Verdict(target, num.median if num else None, den.stat(target.den_stat) if den else None))
    return out


def format_verdicts(results: Results) -> list[str]:
    not_cold = "none" in results.cold
    lines = []
    for v in verdicts(results):
        t = v.target
        if v.ratio is None:
            lines.append(f"{t.label:<36} n/a (needs {t.num} and {t.den}; part not run or failed)   target <= {t.limit}")
            continue
        flag = "PASS" if v.passed else "FAIL"
        caveat = " (page cache NOT dropped: not cold)" if not_cold and "cold" in t.den else ""
        lines.append(
            f"{t.label:<36} {v.num_s:.3f} s / {v.den_s:.3f} s = {v.ratio:5.2f}   target <= {t.limit:<4} {flag}{caveat}"
        )
    return lines


def summary_json(args: argparse.Namespace, machine: dict[str, Any], shape: Shape, nbytes: int, ntensors: int, results: Results) -> dict[str, Any]:
    return {
        "machine": machine,
        "state": {"bytes": nbytes, "tensors": ntensors, "hidden": shape.hidden, "vocab": shape.vocab, "layers": shape.layers},
        "reps": args.reps,
        "page_cache": sorted(results.cold),
        "timings": {
            k: {"times_s": list(t.times), "median_s": t.median, "best_s": t.best, "bytes": t.nbytes}
            for k, t in results.timings.items()
        },
        "targets": [
            {"target": v.target.label, "ratio": v.ratio, "limit": v.target.limit, "passed": v.passed} for v in verdicts(results)
        ],
        "notes": results.notes,
        "errors": results.errors,
    }


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="size of the state in GiB (default: 1)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (default: 3)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on the disk under test, not a tmpfs (default: ./bench-out)")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run, of {','.join(PARTS)} (default: all)")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for ckptd's arenas, e.g. one mounted with huge=always (default: /dev/shm)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and daemon logs under --out (kept anyway when a part fails)")
    p.add_argument("--json", action="store_true", help="also print a JSON summary at the end")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"--only: unknown part(s) {', '.join(unknown)}; use some of {', '.join(PARTS)}")
    if args.size_gib <= 0 or args.reps < 1:
        p.error("--size-gib must be > 0 and --reps >= 1")
    return args


BENCHES: dict[str, Callable[[State, Path, int, Results], None]] = {
    "floors": bench_floors,
    "dcp": bench_dcp,
    "ckptd": bench_ckptd,
}


def run_part(name: str, bench: Callable[..., None], state: State, workdir: Path, reps: int, results: Results) -> None:
    """Run one part; a failure is recorded and printed, and the other parts still run."""
    from torch.distributed.checkpoint.api import CheckpointException

    print(f"running {name} ...", flush=True)
    start = time.perf_counter()
    try:
        bench(state, workdir, reps, results)
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        results.errors[name] = f"{type(exc).__name__}: {exc}"
        print(f"  {name} FAILED: {results.errors[name]}", flush=True)
    print(f"  {name} took {time.perf_counter() - start:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    from ckptd.daemon.app.server import mount_of

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=args.out.resolve()))
    machine = machine_info(workdir)
    shape = shape_for(int(args.size_gib * GIB))
    state = make_state(shape)
    nbytes, ntensors = state_bytes(state), sum(1 for _ in tensors(state))

    header = [
        "ckptd save/restore benchmark (tests/bench/bench_save.py)",
        f"machine: {machine['cores']} cores ({machine['usable_cores']} usable), {machine['ram_gib']} GiB RAM, {machine['kernel']}",
        f"software: Python {machine['python']}, torch {machine['torch']} ({machine['torch_threads']} threads), numpy {machine['numpy']}",
        f"state: {ntensors} fp32 tensors, {nbytes:,} bytes ({nbytes / GIB:.2f} GiB): weights + AdamW exp_avg, exp_avg_sq "
        f"of a {shape.layers}-layer transformer, hidden {shape.hidden}, vocab {shape.vocab}",
        f"scratch: {workdir} ({machine['out_fs']})   reps: {args.reps}   parts: {','.join(args.parts)}   ckptd arenas in: {args.shm_dir} ({mount_of(args.shm_dir)[1] or 'mount options unknown'})",
        f"load average at start: {load_average()}",
    ]
    print("\n".join(header), flush=True)
    if machine["out_fs"] in ("tmpfs", "ramfs"):
        print("warning: --out is in memory, not on a disk: the disk figures are not disk figures", flush=True)

    results = Results()
    for name in PARTS:
        if name in args.parts:
            bench = BENCHES[name]
            if name == "ckptd":
                bench = functools.partial(bench_ckptd, shm_parent=args.shm_dir, paired="dcp" in args.parts)
            run_part(name, bench, state, workdir, args.reps, results)
            gc.collect()
    if args.keep or results.errors:
        results.notes.append(f"kept {workdir} (checkpoints, daemon logs)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)

    cold = ", ".join(sorted(results.cold)) or "not needed"
    print()
    print("\n".join(header))
    print(f"load average at end:   {load_average()}  (other work on the machine skews the figures: compare min - max)")
    print(f"timings: seconds, median of {args.reps} unless marked [best]; GB/s = 1e9 bytes/s at that time; cold = page cache dropped by {cold}")
    print()
    print("\n".join(format_table(results)))
    print()
    print("targets (ckptd medians against the DCP medians and the floors):")
    print("\n".join(format_verdicts(results)))
    for note in results.notes:
        print(f"note: {note}")
    for part, error in results.errors.items():
        print(f"ERROR in {part}: {error}")
    if args.json:
        print()
        print(json.dumps(summary_json(args, machine, shape, nbytes, ntensors, results), indent=2))
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
