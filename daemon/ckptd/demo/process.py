"""Start and stop a real `ckptd serve` process (for the demo, tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class DaemonStartError(RuntimeError):
    """The daemon process exited or did not become healthy in time."""


@dataclass
class DaemonProcess:
    """A `ckptd serve` child process. `address` is what clients pass as `address=`."""

    popen: subprocess.Popen[bytes]
    socket: Path
    root: Path
    log_path: Path | None = None
    _log_file: object | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful: in-flight checkpoints are committed first) and wait; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            self.popen.send_signal(signal.SIGUSR1)  # the daemon writes every thread's stack to its log (cli.py)
            time.sleep(1.0)
            self.popen.kill()
            raise DaemonStartError(
                f"daemon {self.pid} did not stop within {timeout_s} s of SIGTERM; killed it (its threads' stacks are at the end of {self.log_path})"
            ) from exc
        finally:
            self._close_log()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self._close_log()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.popen.poll() is None:
            self.stop()


def wait_healthy(address: str, timeout_s: float, popen: subprocess.Popen[bytes] | None = None) -> None:
    """Block until the daemon at `address` answers SERVING on grpc.health.v1, or raise DaemonStartError."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise DaemonStartError(f"daemon exited with code {popen.returncode} before it was ready")
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last_error = f"health status {reply.status}"
        except grpc.RpcError as exc:
            last_error = exc.details() or str(exc.code())
        time.sleep(0.05)
    raise DaemonStartError(f"daemon at {address} not healthy after {timeout_s} s: {last_error}")


def start_daemon(
    root: Path,
    socket: Path,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    timeout_s: float = 30.0,
) -> DaemonProcess:
    """Run `ckptd serve --root ROOT --socket SOCKET [extra_args]` and return once it is healthy.

    The daemon's stdout/stderr go to `log_path` when given (else they are inherited).
    """
    cmd = [sys.executable, "-m", "ckptd.daemon.app.cli", "serve", "--root", str(root), "--socket", str(socket), *extra_args]
    child_env = dict(os.environ if env is None else env)
    log_file = open(log_path, "ab") if log_path is not None else None
    popen = subprocess.Popen(cmd, env=child_env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None)
    daemon = DaemonProcess(popen=popen, socket=Path(socket), root=Path(root), log_path=log_path, _log_file=log_file)
    try:
        wait_healthy(daemon.address, timeout_s, popen)
    except DaemonStartError as exc:
        daemon.kill()
        raise DaemonStartError(f"{exc}\n{daemon.log_text()[-4000:]}") from None
    return daemon
