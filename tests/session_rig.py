"""The processes left in a session (a benchmark started with start_new_session=True): what its
smoke tests check is empty once it exited."""

from __future__ import annotations

import time
from pathlib import Path


def left_in_session(sid: int, wait_s: float = 10.0) -> list[str]:
    """The processes still in the benchmark's session (daemons, DCP's process, multiprocessing's
    resource tracker, which exits shortly after its parent), as 'pid comm', after up to wait_s."""
    deadline = time.monotonic() + wait_s
    while (left := _in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _in_session(sid: int) -> list[str]:
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6: session id
            left.append(f"{stat.parent.name} {text.split(' ', 2)[1]}")
    return left
