"""`ckptd import` in a process that the test-only fault injector (ckptd.daemon.faults.files) kills at
the N-th file event under the root: `python import_crash.py SOURCE ROOT JOB STEP`, with
CKPTD_FAULT_KILL_AT=N and/or CKPTD_FAULT_LOG=PATH in the environment (see faults.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ckptd.daemon.faults.files import install_from_env
from ckptd.daemon.importer.importing import import_checkpoint

if __name__ == "__main__":
    source, root, job, step = sys.argv[1:]
    injector = install_from_env(os.environ, Path(root))
    assert injector is not None, "set CKPTD_FAULT_KILL_AT or CKPTD_FAULT_LOG"
    injector.arm()
    import_checkpoint(source, root, job, int(step), write_threads=1)
