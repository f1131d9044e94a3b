"""Real daemons for tests: a DaemonFactory of `ckptd serve` processes sharing one root, a
NodeSet of several nodes on loopback, free ports. The fixtures in conftest.py build on these;
test modules import them from here (`from daemon_rig import NodeSet`), not from conftest."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ckptd.demo.process import DaemonProcess, start_daemon


class DaemonFactory:
    """Starts `ckptd serve` processes that share one root (restarts) and stops them at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-t-"))  # short: Unix socket paths are limited
        self.shm_dir = Path(tempfile.mkdtemp(prefix="ckptd-test-", dir="/dev/shm"))
        self.started: list[DaemonProcess] = []

    def start(self, *extra_args: str) -> DaemonProcess:
        daemon = start_daemon(
            root=self.root,
            socket=self.sock_dir / "d.sock",
            extra_args=["--shm-dir", str(self.shm_dir), *extra_args],
            log_path=self.root.parent / f"daemon-{len(self.started)}.log",
        )
        self.started.append(daemon)
        return daemon

    def running(self, *extra_args: str) -> DaemonProcess:
        """The daemon started last if it still runs, else a new one started with `extra_args` (a
        daemon shared by several tests, started again after one that stopped or killed it)."""
        if self.started and self.started[-1].popen.poll() is None:
            return self.started[-1]
        return self.start(*extra_args)

    def arenas(self) -> list[Path]:
        return sorted(self.shm_dir.iterdir())

    def close(self) -> None:
        for daemon in self.started:
            if daemon.popen.poll() is None:
                daemon.kill()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


PEER_TOKEN = "test-peer-token-0123456789"


def metadata_digest(metas: Sequence[Any]) -> str:
    """The digest a daemon names a rank's tensor metadata by over the Peer service
    (plan.spec_digest of the validated TensorMeta messages): node 0 refuses metadata sent under another."""
    from ckptd.daemon.rpc.validate import tensor_specs
    from ckptd.daemon.plan.save_plan import spec_digest

    return spec_digest(tensor_specs(metas))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1, below the kernel's ephemeral range.

    Not port 0's pick: that comes from the ephemeral range, which every outgoing connection
    (a daemon calling a peer, a test scraping metrics) also draws its local port from, so a port
    chosen there and bound a moment later by a daemon can be taken in between ("Address already
    in use"). Each port is held bound until all are chosen (ports chosen one after the other
    could repeat, and a daemon refuses a --peers list that names one twice)."""
    import contextlib
    import random
    import socket

    low = _ephemeral_low()
    draw = random.Random(os.urandom(8))
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            port = draw.randrange(_PORTS_FROM, low)
            s = held.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
        return ports


_PORTS_FROM = 20000  # above the ports services commonly listen on


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's /proc setting; 32768 when unread)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > _PORTS_FROM + 1000 else 32768


class NodeSet:
    """Daemons of several nodes on loopback: each with its own socket, shared memory and root
    (or one root shared by all: `shared_root`), peers on free TCP ports, one peer token."""

    def __init__(self, base: Path, nodes: int, shared_root: bool) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.shared_root = shared_root
        self.peers = [f"127.0.0.1:{port}" for port in free_ports(nodes)]
        self.nodes = [DaemonFactory(base / ("root" if shared_root else f"root-{n}")) for n in range(nodes)]
        self.running: dict[int, DaemonProcess] = {}

    def root(self, node: int) -> Path:
        return self.nodes[node].root

    def start(self, node: int, *extra_args: str) -> DaemonProcess:
        import os

        factory = self.nodes[node]
        daemon = start_daemon(
            root=factory.root,
            socket=factory.sock_dir / "d.sock",
            extra_args=["--shm-dir", str(factory.shm_dir), "--node-rank", str(node), "--peers", ",".join(self.peers), *extra_args],
            env={**os.environ, "CKPTD_PEER_TOKEN": PEER_TOKEN},
            log_path=self.base / f"node{node}-{len(factory.started)}.log",
        )
        factory.started.append(daemon)
        self.running[node] = daemon
        return daemon

    def start_all(self, *extra_args: str) -> list[DaemonProcess]:
        return [self.start(n, *extra_args) for n in range(len(self.nodes))]

    def address(self, node: int) -> str:
        return self.running[node].address

    def close(self) -> None:
        for factory in self.nodes:
            factory.close()
