"""Shared fixtures: real daemons in temporary roots, each with its own socket and shm directory."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ckptd.demo.process import DaemonProcess, start_daemon

# Test modules are imported by path (--import-mode=importlib); shared test code at the top of
# tests/ (fakecuda.py, the strict CUDA stand-in) is imported by name from here on.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA: skipped, with the reason, where torch sees no GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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

    def arenas(self) -> list[Path]:
        return sorted(self.shm_dir.iterdir())

    def close(self) -> None:
        for daemon in self.started:
            if daemon.popen.poll() is None:
                daemon.kill()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(tmp_path / "root")
    yield factory
    factory.close()


@pytest.fixture
def daemon(daemons: DaemonFactory) -> DaemonProcess:
    return daemons.start()


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonFactory]:
    """A DaemonFactory shared by the tests of one module (for expensive set-ups such as a save)."""
    factory = DaemonFactory(tmp_path_factory.mktemp("module") / "root")
    yield factory
    factory.close()


PEER_TOKEN = "test-peer-token-0123456789"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeSet:
    """Daemons of several nodes on loopback: each with its own socket, shared memory and root
    (or one root shared by all: `shared_root`), peers on free TCP ports, one peer token."""

    def __init__(self, base: Path, nodes: int, shared_root: bool) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.shared_root = shared_root
        self.peers = [f"127.0.0.1:{free_port()}" for _ in range(nodes)]
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


def _node_set_factory(base: Path) -> tuple[Callable[..., NodeSet], list[NodeSet]]:
    made: list[NodeSet] = []

    def make(nodes: int, shared_root: bool = True) -> NodeSet:
        made.append(NodeSet(base / f"cluster{len(made)}", nodes, shared_root))
        return made[-1]

    return make, made


@pytest.fixture
def node_sets(tmp_path: Path) -> Iterator[Callable[..., NodeSet]]:
    """make(nodes, shared_root=True) -> a NodeSet (not started); all are stopped at the end."""
    make, made = _node_set_factory(tmp_path)
    yield make
    for node_set in made:
        node_set.close()


@pytest.fixture(scope="module")
def module_node_sets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., NodeSet]]:
    """node_sets shared by the tests of one module."""
    make, made = _node_set_factory(tmp_path_factory.mktemp("nodes"))
    yield make
    for node_set in made:
        node_set.close()


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()
