"""`ckptd serve` with the CUDA stand-in's shared device memory as its CUDA runtime (benchmarks only).

    python tests/bench/fake_gpu_daemon.py DEVICE_DIR serve --root ... --socket ...

The daemon loads tests/fakecuda.py's SharedDeviceLib (device memory in files of DEVICE_DIR)
instead of libcudart, so a client under the same stand-in in another process can hand it a
staging buffer (mode "ipc"): it opens the 64-byte handle, page-locks its arenas and drains the
buffer with cudaMemcpy as on a GPU, with the stand-in's rules enforced. Nothing else differs
from `python -m ckptd.daemon.app.cli`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fakecuda


def shared_runtime(directory: str) -> object:
    """The CudaRuntime wrapper over a SharedDeviceLib of `directory` (what both sides load)."""
    import fakecuda
    from ckptd.common.cudart import CudaRuntime

    runtime = CudaRuntime(fakecuda.SharedDeviceLib(directory), "fakecuda-shared")  # type: ignore[arg-type]
    runtime._declare()
    return runtime


def main(argv: list[str]) -> int:
    from ckptd.common.cudart import CudaRuntime
    from ckptd.daemon.app import cli

    runtime = shared_runtime(argv[0])
    CudaRuntime.load = staticmethod(lambda *args, **kwargs: runtime)  # type: ignore[method-assign]
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
