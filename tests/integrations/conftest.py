"""Shared by the tests of ckptd.integrations: the one-thread fixture (a worker process and this
one sum in the same order). Worker scripts are loaded and run with tests/worker_process.py."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train in this process with the one intra-op thread the worker processes use (equal sums)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
