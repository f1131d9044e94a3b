"""Operating a real daemon: ckptd status during a slow save, verify, gc, ls, retention across 30
saves with metrics, the Prometheus endpoint scraped over HTTP, and health while it drains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from metrics_scrape import scrape  # tests/metrics_scrape.py
from on_disk import committed  # tests/on_disk.py
from ckptd.client import CheckpointClient
from ckptd.format.index import INDEX_NAME
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc
from daemon_rig import free_port


def ckptd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", *args], capture_output=True, text=True, timeout=120, env=env)


# ------------------------------------------------------------------ status


def test_status_shows_a_save_in_progress(daemons) -> None:
    daemon = daemons.start("--write-throttle", "8MiB")  # a slow disk: 32 MiB take about 4 s
    state = {"model": torch.nn.Linear(2048, 4096)}  # 32 MiB of fp32
    with CheckpointClient("slow", address=daemon.address, on_error="raise") as ckpt:
        handle = ckpt.save(1, state)
        time.sleep(0.5)
        out = ckptd("status", "--address", daemon.address)
        assert out.returncode == 0, out.stderr
        line = next(line for line in out.stdout.splitlines() if line.startswith("slow"))
        assert line.split()[1:3] == ["1", "writing"], out.stdout
        assert "[" in line and "%" in line and "MiB / 32 MiB" in line, out.stdout
        assert "queue depth 1" in out.stdout and "arenas: 1" in out.stdout  # one set per job: no spare made ahead
        assert "job slow: 32 MiB in 1 arena set(s); 1 save(s) in flight; in use" in out.stdout, out.stdout

        doc = json.loads(ckptd("status", "--address", daemon.address, "--json").stdout)
        (flight,) = doc["in_flight"]
        assert (flight["job"], flight["step"], flight["state"]) == ("slow", 1, "writing")
        assert 0 < flight["bytes_written"] < flight["bytes_total"] == 2048 * 4096 * 4 + 4096 * 4
        assert doc["queue_depth"] == 1 and doc["arena_bytes"] >= flight["bytes_total"] and doc["last_commit"] is None

        info = handle.wait_durable(timeout=120)
    done = json.loads(ckptd("status", "--address", daemon.address, "--json").stdout)
    assert done["in_flight"] == [] and done["queue_depth"] == 0 and done["committed_total"] == 1
    assert (done["last_commit"]["job"], done["last_commit"]["step"], done["last_commit"]["step_dir"]) == ("slow", 1, info.step_dir)
    assert done["last_commit"]["latency_s"] > 2.0  # the throttle held the write back
    text = ckptd("status", "--address", daemon.address).stdout
    assert "no checkpoint in flight" in text and "last commit: job slow step 1" in text


def test_status_and_gc_explain_a_daemon_that_is_not_there(tmp_path: Path) -> None:
    for command in ("status", "gc"):
        out = ckptd(command, "--address", f"unix://{tmp_path}/none.sock")
        assert out.returncode == 1 and "no daemon socket" in out.stderr and "CKPTD_ADDRESS" in out.stderr


# issue 30 finding 11
def test_issue30_finding11_status_takes_the_sockets_bare_path(daemon) -> None:
    socket = daemon.address.removeprefix("unix://")
    out = ckptd("status", "--address", socket, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["address"] == daemon.address
    wrong = ckptd("gc", "--address", "localhost:50051")
    assert wrong.returncode == 1 and "is not a Unix socket" in wrong.stderr and "unix:///path/to/ckptd.sock" in wrong.stderr


# ------------------------------------------------------------------ verify


def test_verify_a_job_directory_checks_each_committed_step(daemon, tmp_path: Path) -> None:
    """Issue 22 item 8: `ckptd verify ROOT/JOB` verifies the job's steps (it called the job
    directory an interrupted save); an uncommitted step directory is a note, a damaged step fails."""
    with CheckpointClient("whole", address=daemon.address, on_error="raise") as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": torch.nn.Linear(8, 4)}).wait_durable(timeout=60)
    job_dir = daemon.root / "whole"
    ok = ckptd("verify", str(job_dir))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("verifying ") == 2 and "OK: 2 of 2 committed step(s)" in ok.stdout
    doc = json.loads(ckptd("verify", str(job_dir), "--json").stdout)
    assert doc["ok"] is True and [s["step"] for s in doc["steps"]] == [1, 2] and doc["interrupted"] == []

    copy = tmp_path / "copy-root" / "whole"
    shutil.copytree(job_dir, copy, symlinks=True)
    (copy / "step-00000009").mkdir()  # a save that never committed
    (copy / "step-00000001" / "extra.json").write_text("{}")  # a damaged small file
    out = ckptd("verify", str(copy))
    assert out.returncode == 1 and "FAILED: 1 of 2 committed step(s)" in out.stdout, out.stdout
    assert "step-00000009 has no index: an interrupted save" in out.stdout
    root = ckptd("verify", str(tmp_path / "copy-root"))  # a root: neither a step nor a job directory
    assert root.returncode == 2 and "is a storage root; give one of its jobs" in root.stderr


def test_ckptd_version() -> None:
    out = ckptd("--version")
    assert out.returncode == 0 and out.stdout.strip() == "ckptd 0.1.0"


def test_verify_catches_a_flipped_byte_and_a_missing_file(daemon, tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with CheckpointClient("checked", address=daemon.address, on_error="raise") as ckpt:
        step_dir = Path(ckpt.save(7, {"model": model, "optimizer": opt, "extra": {"epoch": 1}}).wait_durable(timeout=60).step_dir)

    ok = ckptd("verify", str(step_dir))
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("OK:"), ok.stdout + ok.stderr
    assert json.loads(ckptd("verify", str(step_dir), "--json").stdout)["ok"] is True

    index = json.loads((step_dir / INDEX_NAME).read_text())
    frag = index["tensors"]["model/0.weight"]["fragments"][0]
    flipped = tmp_path / "flipped"
    shutil.copytree(step_dir, flipped)
    with open(flipped / frag["file"], "r+b") as f:  # one bit in the middle of the tensor's data
        f.seek(frag["offset"] + frag["nbytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    out = ckptd("verify", str(flipped))
    assert out.returncode == 1 and "FAILED: 1 problem" in out.stdout, out.stdout
    assert "model/0.weight" in out.stdout and "does not match its checksum" in out.stdout
    doc = json.loads(ckptd("verify", str(flipped), "--json").stdout)
    assert doc["ok"] is False and [(p["kind"], p["file"]) for p in doc["problems"]] == [("checksum", frag["file"])]

    missing = tmp_path / "missing"
    shutil.copytree(step_dir, missing)
    optimizer_file = next(name for name in index["files"] if name.startswith("optimizer-"))
    (missing / optimizer_file).unlink()
    out = ckptd("verify", str(missing))
    assert out.returncode == 1 and f"{optimizer_file} is missing" in out.stdout and "optimizer/state/0.weight/exp_avg" in out.stdout

    small = tmp_path / "small"  # a small file changed
    shutil.copytree(step_dir, small)
    (small / "extra.json").write_text((small / "extra.json").read_text().replace('"epoch":1', '"epoch":2'))
    out = ckptd("verify", str(small), "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["problems"][0]["file"] == "extra.json"

    chunks = tmp_path / "chunks"  # chunk checksums that do not fit the data: resharded loads would fail
    shutil.copytree(step_dir, chunks)
    damaged = json.loads((chunks / INDEX_NAME).read_text())
    digests = damaged["tensors"]["model/0.weight"]["fragments"][0]["chunks"]["xxh3"]
    damaged["tensors"]["model/0.weight"]["fragments"][0]["chunks"]["xxh3"] = ("0" if digests[0] != "0" else "1") + digests[1:]
    (chunks / INDEX_NAME).write_text(json.dumps(damaged))
    out = ckptd("verify", str(chunks))
    assert out.returncode == 1 and "model/0.weight" in out.stdout and "not its chunk checksums" in out.stdout, out.stdout

    (uncommitted := tmp_path / "step-00000009").mkdir()
    out = ckptd("verify", str(uncommitted))
    assert out.returncode == 1 and "not a committed checkpoint" in out.stdout
    assert ckptd("verify", str(tmp_path / "nowhere")).returncode == 2


# ------------------------------------------------------------------ gc and ls


def test_gc_removes_leftovers_but_not_committed_steps(daemon) -> None:
    with CheckpointClient("gc", address=daemon.address, on_error="raise") as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": torch.nn.Linear(8, 8)}).wait_durable(timeout=60)
    job_dir = daemon.root / "gc"
    (job_dir / "step-00000005").mkdir()  # a save that crashed before its index
    (job_dir / "step-00000005" / "model-00001-of-00001.safetensors").write_bytes(b"x" * 1000)
    (job_dir / "step-00000002" / ".tmp-extra.json.123").write_bytes(b"{}")

    listed = json.loads(ckptd("ls", str(daemon.root), "gc", "--all", "--json").stdout)
    assert [(r["step"], r["state"], r["latest"]) for r in listed] == [(1, "committed", False), (2, "committed", True), (5, "uncommitted", False)]
    assert "(uncommitted" in ckptd("ls", str(daemon.root), "--all").stdout

    dry = json.loads(ckptd("gc", "--address", daemon.address, "--dry-run", "--json").stdout)
    # also the held snapshot of step 2 (its memory; the step stays on disk)
    assert sorted((r["step"], r["reason"]) for r in dry["removed"]) == [(2, "memory"), (2, "temporary"), (5, "uncommitted")]
    assert (job_dir / "step-00000005").exists()

    out = ckptd("gc", "--address", daemon.address)
    assert out.returncode == 0 and "removed 3 item(s)" in out.stdout, out.stdout + out.stderr
    assert not (job_dir / "step-00000005").exists() and not (job_dir / "step-00000002" / ".tmp-extra.json.123").exists()
    assert committed(daemon.root, "gc") == [1, 2]
    assert ckptd("verify", str(job_dir / "step-00000002")).returncode == 0
    assert "removed 0 item(s)" in ckptd("gc", "--address", daemon.address, "--job", "gc").stdout


# ------------------------------------------------------------------ retention


# The metric each step is saved with (a loss: lower is better); best two: step 70 (0.05), step 130 (0.10).
METRICS = {10 * i: m for i, m in enumerate(
    [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.05, 0.45, 0.35, 0.3, 0.25, 0.2, 0.10, 0.3, 0.3,
     0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], start=1)}


def expected_kept(saved: list[int], reading: set[int]) -> set[int]:
    """The policy of the test, written out: last 3, every 100th, best 2 by metric, and steps being read."""
    best = sorted(saved, key=lambda s: (METRICS[s], -s))[:2]
    return set(saved[-3:]) | {s for s in saved if s % 100 == 0} | set(best) | (reading & set(saved))


def test_retention_keeps_exactly_what_the_policy_says_across_30_saves(daemons) -> None:
    port = free_port()
    daemon = daemons.start("--keep-last", "3", "--keep-every", "100", "--keep-best", "2", "--best-mode", "min", "--metrics-port", str(port))
    model = torch.nn.Linear(16, 16)
    saved: list[int] = []
    reading: set[int] = set()
    with CheckpointClient("kept", address=daemon.address, on_error="raise") as ckpt, grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.CheckpointStub(channel)
        load_id = ""
        who = pb.RankId(job="kept", rank=0, world_size=1)
        for step in sorted(METRICS):
            if step == 200:  # the load ends: the next commit's retention may delete step 40
                stub.LoadDone(pb.LoadDoneRequest(who=who, load_id=load_id), timeout=30)
                reading = set()
            ckpt.save(step, {"model": model}, metric=METRICS[step]).wait_durable(timeout=60)
            saved.append(step)
            if step == 40:  # a load of step 40 begins (an evaluation job reading it): 40 must survive meanwhile
                load_id = stub.PlanLoad(pb.PlanLoadRequest(who=who, step=40, strict=False), timeout=30).load_id
                reading = {40}
            assert set(committed(daemon.root, "kept")) == expected_kept(saved, reading), f"after step {step}"
    final = {70, 100, 130, 200, 280, 290, 300}
    assert set(committed(daemon.root, "kept")) == final

    rows = json.loads(ckptd("ls", str(daemon.root), "kept", "--json").stdout)
    assert [(r["step"], r["metric"]) for r in rows] == [(s, pytest.approx(METRICS[s])) for s in sorted(final)]
    metrics = scrape(port)
    assert metrics['ckptd_commits_total{job="kept"}'] == 30
    assert metrics['ckptd_retention_deleted_steps_total{job="kept"}'] == 30 - len(final)
    assert metrics['ckptd_last_committed_step{job="kept"}'] == 300


def test_sighup_reloads_retention(daemons, tmp_path: Path) -> None:
    config = tmp_path / "ckptd.toml"
    config.write_text("[retention]\nkeep_last = 0\n")
    daemon = daemons.start("--config", str(config))
    model = torch.nn.Linear(4, 4)
    with CheckpointClient("hup", address=daemon.address, on_error="raise") as ckpt:
        for step in range(1, 6):
            ckpt.save(step, {"model": model}).wait_durable(timeout=60)
        assert committed(daemon.root, "hup") == [1, 2, 3, 4, 5]
        config.write_text("[retention]\nkeep_last = 2\n")
        daemon.popen.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "configuration reloaded" not in daemon.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "configuration reloaded" in daemon.log_text()
        ckpt.save(6, {"model": model}).wait_durable(timeout=60)
        assert committed(daemon.root, "hup") == [5, 6]
        config.write_text("[retention]\nkeep_last = -1\n")  # a bad file keeps the old settings
        daemon.popen.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "configuration not reloaded" not in daemon.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "keep_last" in daemon.log_text().split("configuration not reloaded")[1]
        ckpt.save(7, {"model": model}).wait_durable(timeout=60)
        assert committed(daemon.root, "hup") == [6, 7]
    assert daemon.popen.poll() is None


# ------------------------------------------------------------------ metrics


def test_metrics_endpoint_serves_the_expected_series(daemons) -> None:
    port = free_port()
    health_port = free_port()
    daemon = daemons.start("--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--health-port", str(health_port), "--log-json")
    model = torch.nn.Linear(256, 256)
    with CheckpointClient("scraped", address=daemon.address, on_error="raise") as ckpt:
        handles = [ckpt.save(step, {"model": model}) for step in (1, 2)]
        infos = [h.wait_durable(timeout=60) for h in handles]
        ckpt.load({"model": model})
    # a save that a rank gives up on: counted as a failure with its cause
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.CheckpointStub(channel)
        who = pb.RankId(job="scraped", rank=0, world_size=1)
        meta = pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[0], lengths=[4]))
        begun = stub.BeginSave(pb.BeginSaveRequest(who=who, step=3, fingerprint="f-abort", tensors=[meta], timeout_s=30), timeout=30)
        stub.AbortSave(pb.AbortSaveRequest(who=who, save_id=begun.save_id, reason="copy failed"), timeout=30)

    m = scrape(port)
    written = sum(os.path.getsize(Path(infos[0].step_dir) / f) for f in os.listdir(infos[0].step_dir) if f.endswith(".safetensors"))
    assert m['ckptd_stall_seconds_count{job="scraped"}'] == 2 and 0 < m['ckptd_stall_seconds_sum{job="scraped"}'] < 10
    assert m['ckptd_written_bytes_total{job="scraped"}'] == 2 * written
    assert m['ckptd_write_throughput_bytes_per_second{job="scraped"}'] > 0
    assert m['ckptd_commit_latency_seconds_count{job="scraped"}'] == 2
    assert m['ckptd_commits_total{job="scraped"}'] == 2
    assert m['ckptd_save_failures_total{cause="rank_aborted"}'] == 1
    assert m['ckptd_save_failures_total{cause="write_error"}'] == 0
    assert m['ckptd_queue_depth{job="scraped"}'] == 0
    assert m["ckptd_arena_bytes"] >= 256 * 256 * 4 and m["ckptd_arenas"] >= 1
    assert m['ckptd_loads_total{tier="memory"}'] == 1
    assert m["ckptd_draining"] == 0
    assert m['ckptd_info{node="0",version="0.1.0"}'] == 1

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == health_pb2.HealthCheckResponse.SERVING

    logs = [json.loads(line) for line in daemon.log_text().splitlines() if line.startswith("{")]
    commits = [r for r in logs if r["message"].startswith("committed step")]
    assert [(r["job"], r["step"], r["node"]) for r in commits] == [("scraped", 1, 0), ("scraped", 2, 0)]
    failure = next(r for r in logs if r.get("cause") == "rank_aborted")
    assert (failure["job"], failure["step"], failure["level"]) == ("scraped", 3, "warning")


def test_a_draining_daemon_is_not_ready_but_alive(daemons) -> None:
    """SIGTERM with a snapshot open: while the daemon drains, readiness ("" and the Checkpoint
    service) is NOT_SERVING on the socket and on --health-port, `liveness` stays SERVING (a
    probe must not kill a daemon that is committing), and it exits 0 once the save is decided."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health_port = free_port()
    daemon = daemons.start("--metrics-host", "127.0.0.1", "--health-port", str(health_port))
    who = pb.RankId(job="drained", rank=0, world_size=1)
    meta = pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[0], lengths=[4]))
    with grpc.insecure_channel(daemon.address) as channel, grpc.insecure_channel(f"127.0.0.1:{health_port}") as probe:
        stub = pb_grpc.CheckpointStub(channel)
        stub.BeginSave(pb.BeginSaveRequest(who=who, step=1, fingerprint="f-drain", tensors=[meta], timeout_s=4), timeout=30)  # never handed over
        daemon.popen.send_signal(signal.SIGTERM)
        socket_health, tcp_health = health_pb2_grpc.HealthStub(channel), health_pb2_grpc.HealthStub(probe)

        def status(health: health_pb2_grpc.HealthStub, service: str) -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

        deadline = time.monotonic() + 10
        while status(socket_health, "") != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        for health in (socket_health, tcp_health):
            assert [status(health, s) for s in ("", "ckptd.v1.Checkpoint", "liveness")] == [
                health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING,
            ]
    assert daemon.stop(timeout_s=60) == 0


def test_a_busy_metrics_port_is_a_clear_start_error(daemons, tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = ckptd("serve", "--root", str(tmp_path / "r"), "--socket", str(daemons.sock_dir / "busy.sock"), "--shm-dir", str(daemons.shm_dir),
                    "--metrics-host", "127.0.0.1", "--metrics-port", str(port))
    assert out.returncode == 1 and "cannot serve metrics" in out.stderr and "--metrics-port" in out.stderr
