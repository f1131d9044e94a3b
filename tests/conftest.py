"""Shared fixtures: real daemons in temporary roots, each with its own socket and shm directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ckptd.demo.process import DaemonProcess

# Test modules are imported by path (--import-mode=importlib); shared test code at the top of
# tests/ (fakecuda.py, the strict CUDA stand-in; daemon_rig.py, the daemons the fixtures start) is
# imported by name from here on. Test modules import it from there, never `from conftest`: which
# conftest that name finds depends on the order pytest collected the directories in.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_rig import DaemonFactory, NodeSet, free_port  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA: skipped, with the reason, where torch sees no GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture
def shared_daemon(module_daemons: DaemonFactory) -> DaemonProcess:
    """The module's daemon (default settings, on module_daemons' root), shared by the module's tests
    that ask for it instead of each starting its own; each of them saves under a job of its own.
    Started by the first such test, and again after a test that left it stopped or dead, so one
    test's failure does not fail the next. A module that asks for it uses module_daemons for
    nothing else."""
    return module_daemons.running()


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
