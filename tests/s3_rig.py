"""Helpers of the object-store tier's tests and benchmark (tests/remote/, tests/bench/bench_s3_tier.py):
daemons started with `--remote` against the SeaweedFS server of tests/s3_server.py, a server
that can be killed and started again on the same ports and data, and an independent look at
the bucket (boto3, not the tier's own code) that checks every visible step is complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import boto3
import torch

from ckptd.client import CheckpointClient
from ckptd.format.index import INDEX_NAME, CheckpointIndex
from ckptd.daemon.tools.verify import verify_step
from ckptd.demo.process import DaemonProcess, start_daemon
from s3_server import S3Server, _pick_ports, _remove_grpc_sockets, _SERVICES, _start, _stop_group

# Keep the daemons away from the developer's own AWS configuration and from instance metadata.
ISOLATED_AWS = {"AWS_CONFIG_FILE": "/nonexistent/ckptd-test-aws-config", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ckptd-test-aws-credentials",
                "AWS_EC2_METADATA_DISABLED": "true"}


def daemon_env(server: S3Server, **extra: str) -> dict[str, str]:
    """The environment of a daemon that talks to `server`: the AWS variables, nothing else of AWS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPTD_FAULT_"))}
    return {**env, **ISOLATED_AWS, **server.aws_env(), **extra}


def s3_client(server: S3Server) -> Any:
    return boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=server.access_key_id,
                        aws_secret_access_key=server.secret_access_key, region_name=server.region)


@dataclass
class Node:
    """One daemon's places: root, socket, shared memory (removed by `close`)."""

    root: Path
    sock_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ckptd-s3-")))
    shm: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ckptd-s3-", dir="/dev/shm")))
    daemon: DaemonProcess | None = None
    starts: int = 0

    def start(self, remote: str, env: Mapping[str, str], *args: str, timeout_s: float = 30.0) -> DaemonProcess:
        self.starts += 1
        self.daemon = start_daemon(self.root, self.sock_dir / "d.sock", ["--shm-dir", str(self.shm), "--remote", remote, *args],
                                   env=env, log_path=self.root.parent / f"{self.root.name}-daemon-{self.starts}.log", timeout_s=timeout_s)
        return self.daemon

    def run(self, remote: str, env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        """`ckptd serve` that is expected to exit (a start refused): its exit code and output."""
        import sys

        cmd = [sys.executable, "-m", "ckptd.daemon.app.cli", "serve", "--root", str(self.root), "--socket", str(self.sock_dir / "d.sock"),
               "--shm-dir", str(self.shm), "--remote", remote, *args]
        return subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=60)

    def client(self, job: str, rank: int = 0, world_size: int = 1, **kwargs: Any) -> CheckpointClient:
        """A rank of `job` on this node (one rank per node)."""
        assert self.daemon is not None
        return CheckpointClient(job, address=self.daemon.address, rank=rank, world_size=world_size, local_world_size=1, on_error="raise",
                                timeout_s=60, **kwargs)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.popen.poll() is None:
            self.daemon.stop()

    def close(self) -> None:
        if self.daemon is not None and self.daemon.popen.poll() is None:
            self.daemon.kill()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def save_steps(node: Node, job: str, steps: Sequence[int], nbytes: int = 3 << 20) -> None:
    """Save state_of(step, nbytes) at each step, each durable before the next."""
    with node.client(job) as ckpt:
        for step in steps:
            ckpt.save(step, state_of(step, nbytes)).wait_durable(60)


def state_of(step: int, nbytes: int = 3 << 20, tensors: int = 4) -> dict[str, Any]:
    """A model state of about `nbytes` in `tensors` tensors, distinct per step."""
    g = torch.Generator().manual_seed(step)
    per = max(1, nbytes // 4 // tensors)
    return {"model": {f"layer{i}.w": torch.randn(per, generator=g) for i in range(tensors)}}


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}


def equal_states(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


class StatusPoller:
    """Asks one daemon for its status over one channel (a channel per call would cost the daemon
    a connection each time, which a benchmark polling every few milliseconds must not)."""

    def __init__(self, address: str) -> None:
        import grpc

        from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.CheckpointStub(self.channel)

    def status(self, job: str = "") -> dict[str, Any]:
        """The daemon's `ckptd status --json` document (its Status RPC, as the CLI renders it);
        of `job` alone when given (`ckptd status --job`)."""
        from ckptd.daemon.tools.ops import status_doc
        from ckptd.wire.v1 import checkpoint_pb2 as pb

        return status_doc(self.stub.Status(pb.StatusRequest(job=job), timeout=10), self.address)

    def settled(self) -> dict[str, Any] | None:
        """The tier's status once nothing is pending and it is idle (else None)."""
        remote = self.status()["remote"]
        return remote if remote["pending_steps"] == 0 and remote["state"] == "idle" else None

    def close(self) -> None:
        self.channel.close()


def remote_status(address: str) -> dict[str, Any]:
    """The daemon's `ckptd status --json` document, asked once."""
    poller = StatusPoller(address)
    try:
        return poller.status()
    finally:
        poller.close()


def uploads_settled(address: str) -> dict[str, Any] | None:
    """The tier's status once nothing is pending and it is idle (else None)."""
    poller = StatusPoller(address)
    try:
        return poller.settled()
    finally:
        poller.close()


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


class Bucket:
    """The bucket as an independent client sees it."""

    def __init__(self, server: S3Server, bucket: str, prefix: str) -> None:
        self.client = s3_client(server)
        self.bucket, self.prefix = bucket, prefix

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def keys(self, under: str = "") -> dict[str, int]:
        found: dict[str, int] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/{under}"):
            for obj in page.get("Contents", []):
                found[obj["Key"]] = obj["Size"]
        return found

    def steps(self, job: str) -> list[int]:
        """Steps of the job whose index is in the bucket (visible), ascending."""
        head = f"{self.prefix}/{job}/step-"
        return sorted(int(k[len(head):].split("/")[0]) for k in self.keys(f"{job}/") if k.startswith(head) and k.endswith("/" + INDEX_NAME))

    def unfinished_uploads(self) -> list[str]:
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/").get("Uploads", [])]

    def check_complete(self, job: str, step: int, into: Path) -> CheckpointIndex:
        """Download the visible step into `into` and verify it (every file, every checksum,
        coverage): a half step fails here."""
        step_prefix = f"{self.prefix}/{job}/step-{step:08d}/"
        into.mkdir(parents=True, exist_ok=True)
        data = self.client.get_object(Bucket=self.bucket, Key=step_prefix + INDEX_NAME)["Body"].read()
        index = CheckpointIndex.from_json_bytes(data)
        (into / INDEX_NAME).write_bytes(data)
        for record in index.files:
            body = self.client.get_object(Bucket=self.bucket, Key=step_prefix + record.name)["Body"].read()
            (into / record.name).write_bytes(body)
        report = verify_step(into)
        assert report.ok, report.problems
        return index

    def check_all_complete(self, job: str, scratch: Path) -> list[int]:
        steps = self.steps(job)
        for step in steps:
            self.check_complete(job, step, scratch / f"{job}-{step}-{time.monotonic_ns()}")
        return steps


class RestartableS3:
    """A SeaweedFS server that can be killed (SIGKILL, its whole group) and started again on the
    same ports and data directory (a server that crashed and came back)."""

    def __init__(self, startup_timeout_s: float = 60.0) -> None:
        import random

        self.work = Path(tempfile.mkdtemp(prefix="ckptd-s3r-"))
        self.timeout = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        rng = random.Random()
        for _ in range(5):
            self.ports = dict(zip(_SERVICES, _pick_ports(len(_SERVICES), rng)))
            self.process = _start(self.work, self.ports, self.timeout)
            if self.process is not None:
                break
            _remove_grpc_sockets(self.ports)
        assert self.process is not None, "SeaweedFS did not start"
        from s3_server import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY

        self.server = S3Server(f"http://127.0.0.1:{self.ports['s3']}", ACCESS_KEY_ID, SECRET_ACCESS_KEY, REGION,
                               f"127.0.0.1:{self.ports['master']}", self.work, self.process.pid)

    def kill(self) -> None:
        if self.process is not None:
            _stop_group(self.process, grace_s=0)
            _remove_grpc_sockets(self.ports)
            self.process = None

    def restart(self) -> None:
        assert self.process is None
        self.process = _start(self.work, self.ports, self.timeout)
        assert self.process is not None, "SeaweedFS did not start again on its ports"

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.work, ignore_errors=True)
