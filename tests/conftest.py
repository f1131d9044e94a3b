"""Shared fixtures: real daemons in temporary roots, each with its own socket and shm directory."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ckptd.daemon.process import DaemonProcess, start_daemon


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
