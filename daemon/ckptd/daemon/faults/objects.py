"""Fault injection for tests: kill the daemon at the N-th object-store request of its tier.

TEST-ONLY, in the spirit of ckptd.daemon.faults.files (which counts file events under the root):
nothing here runs unless one of the variables below is set.

- ``CKPTD_FAULT_S3_KILL_AT=N`` (N >= 1): the daemon SIGKILLs itself just before its N-th
  object-store request (requests 1..N-1 happened, N and later did not): no cleanup, no abort of
  a multipart upload in flight, as a power cut would.
- ``CKPTD_FAULT_S3_LOG=PATH``: one JSON line per request, ``{"n": N, "kind": ..., "key": ...}``,
  appended before the request is made; with the kill, the last line is the one not made.
- ``CKPTD_FAULT_S3_ARM_FILE=PATH`` (optional): count only once PATH exists, so a restarted
  daemon can finish its catch-up uploads before the upload the test wants to interrupt.
- ``CKPTD_FAULT_S3_RETRY_S=SECONDS`` (alone or with the others): retry one request for at most
  this long (store.RETRY_TIMEOUT_S otherwise) and wait at most twice that between attempts of a
  step, so that a test of a server outage sees the uploader's own retries within seconds.

A *request* is one call of the tier's object-store wrapper (put, copy, head, get, list, delete,
the multipart sweep) and, inside a file's upload, each part read from the file: a kill between
two parts leaves an unfinished multipart upload, which the tier must keep invisible and sweep.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Mapping

from ckptd.daemon.faults.files import fault_settings

KILL_AT_ENV = "CKPTD_FAULT_S3_KILL_AT"
LOG_ENV = "CKPTD_FAULT_S3_LOG"
ARM_FILE_ENV = "CKPTD_FAULT_S3_ARM_FILE"
RETRY_ENV = "CKPTD_FAULT_S3_RETRY_S"
ENVS = (KILL_AT_ENV, LOG_ENV, RETRY_ENV)  # any of them turns fault injection on


class RequestFaults:
    """Counts object-store requests (thread-safe); kills the process at `kill_at` (None: never)."""

    def __init__(self, kill_at: int | None, log_path: Path | None, arm_file: Path | None) -> None:
        if kill_at is not None and kill_at < 1:
            raise ValueError(f"{KILL_AT_ENV} must be an integer >= 1, got {kill_at}")
        self.kill_at = kill_at
        self.count = 0
        self._log_path = log_path
        self._arm_file = arm_file
        self._lock = threading.Lock()

    def __call__(self, kind: str, key: str) -> None:
        """Called just before a request is made."""
        with self._lock:
            if self._arm_file is not None:
                if not self._arm_file.exists():
                    return
                self._arm_file = None  # armed for good
            self.count += 1
            if self._log_path is not None:
                with open(self._log_path, "a") as log:  # outside the root: the test's own file
                    log.write(json.dumps({"n": self.count, "kind": kind, "key": key}) + "\n")
            if self.kill_at is not None and self.count >= self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)


def retry_s_from_env(env: Mapping[str, str]) -> float | None:
    """CKPTD_FAULT_S3_RETRY_S as seconds, or None when unset."""
    text = env.get(RETRY_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{RETRY_ENV} must be a number of seconds > 0, got {text!r}")
    return value


def from_env(env: Mapping[str, str]) -> RequestFaults | None:
    """The hook the environment asks for, or None (production: nothing is counted)."""
    settings = fault_settings(env, KILL_AT_ENV, LOG_ENV, ARM_FILE_ENV)
    return None if settings is None else RequestFaults(*settings)
