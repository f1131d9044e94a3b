"""The daemon process's garbage-collector schedule (daemon/ckptd/daemon/heap.py)."""

from __future__ import annotations

import gc
import subprocess
import sys

from ckptd.daemon.heap import DUE_AFTER, FULL_EVERY, collect_if_due


def _full_collections_during(action) -> int:
    seen = []

    def note(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            seen.append(info)

    gc.callbacks.append(note)
    try:
        action()
    finally:
        gc.callbacks.remove(note)
    return len(seen)


def test_a_commit_makes_the_full_collection_only_once_pythons_schedule_has_one_due() -> None:
    gc.collect()  # every generation's count back to 0
    assert _full_collections_during(collect_if_due) == 0  # not due: nothing scanned
    for _ in range(DUE_AFTER):
        gc.collect(1)  # each counts one gen-1 collection towards the next full one
    assert gc.get_count()[2] >= DUE_AFTER
    assert _full_collections_during(collect_if_due) == 1
    assert gc.get_count()[2] == 0


def test_the_daemon_process_freezes_what_it_loaded_and_makes_automatic_full_collections_rare() -> None:
    # in a process of its own: the settings are process-wide
    code = "import gc; from ckptd.daemon.heap import quiet_collector; quiet_collector(); print(gc.get_threshold()[2], gc.get_freeze_count() > 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(FULL_EVERY), "True"]
