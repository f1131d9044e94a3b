"""`ckptd serve` with the CUDA stand-in's shared device memory as its CUDA runtime (tests and benchmarks).

    python tests/fake_gpu_daemon.py DEVICE_DIR serve --root ... --socket ...

The daemon loads tests/fakecuda.py's SharedDeviceLib (device memory in files of DEVICE_DIR)
instead of libcudart, so a client under the same stand-in in another process can hand it a
staging buffer (mode "ipc"): it opens the 64-byte handle, page-locks its arenas and drains the
buffer with cudaMemcpy as on a GPU, with the stand-in's rules enforced. Nothing else differs
from `python -m ckptd.daemon.app.cli`. `start` runs one and returns once it is healthy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: fakecuda


def shared_runtime(directory: str) -> object:
    """The CudaRuntime wrapper over a SharedDeviceLib of `directory` (what both sides load)."""
    import fakecuda
    from ckptd.common.cudart import CudaRuntime

    runtime = CudaRuntime(fakecuda.SharedDeviceLib(directory), "fakecuda-shared")  # type: ignore[arg-type]
    runtime._declare()
    return runtime


def start(root: Path, socket: Path, shm_dir: Path, device_dir: Path, log_path: Path) -> Any:
    """Start such a daemon (a ckptd.demo.process.DaemonProcess, healthy when returned); the
    client's FakeCuda must use SharedDeviceLib(device_dir) too."""
    from ckptd.demo.process import DaemonProcess, DaemonStartError, wait_healthy

    cmd = [sys.executable, __file__, str(device_dir), "serve", "--root", str(root), "--socket", str(socket), "--shm-dir", str(shm_dir)]
    log_file = open(log_path, "ab")
    popen = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    daemon = DaemonProcess(popen=popen, socket=socket, root=root, log_path=log_path, _log_file=log_file)
    try:
        wait_healthy(daemon.address, 60, popen)
    except DaemonStartError as exc:
        daemon.kill()
        raise DaemonStartError(f"{exc}\n{daemon.log_text()[-4000:]}") from None
    return daemon


def main(argv: list[str]) -> int:
    from ckptd.common.cudart import CudaRuntime
    from ckptd.daemon.app import cli

    runtime = shared_runtime(argv[0])
    CudaRuntime.load = staticmethod(lambda *args, **kwargs: runtime)  # type: ignore[method-assign]
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
