"""GPU check of CkptdFSDPStrategy (Lightning's FSDPStrategy, torch's FSDP1), which cannot run on
CPU: torch refuses a CPU module (torch/distributed/fsdp/_init_utils.py, _init_device_handle)
and Lightning refuses strategy="fsdp" on CPU (accelerator_connector.py).

`python tests/gpu/lightning_fsdp1.py [--devices N]` (default: every visible GPU; N processes of
one run, NCCL). It starts a daemon in a temporary directory and runs
tests/integrations/lightning_worker.py three times: 10 steps with checkpoints at steps 5 and
10 (each rank hands its FSDP1 shards, DTensors through the strategy's device mesh, to ckptd);
then a resume from step 5's pointer into a new job, trained to step 10; then a resume from
step 10 in one process (another world size when N > 1) that trains no step. It checks that the
resumed run's losses of steps 6-10 are the first run's, and that the whole state (weights, Adam
state, scheduler) after each resume equals the first run's at step 10, bit for bit. Prints
"OK" and exits 0, or fails with an assertion.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from ckptd.demo.process import start_daemon

WORKER = Path(__file__).resolve().parents[1] / "integrations" / "lightning_worker.py"
sys.path.insert(0, str(WORKER.parent))
from lightning_worker import finish, start_ranks  # noqa: E402


def run(spec: dict, devices: int) -> None:
    if devices > 1:
        finish(start_ranks(spec, world_size=devices), timeout=600)
    else:
        subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], check=True, timeout=600)


def losses(path: Path) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in map(json.loads, path.read_text().splitlines())}


def same_state(a: Path, b: Path) -> None:
    ta, tb = load_file(f"{a}.safetensors"), load_file(f"{b}.safetensors")
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta), f"{a} and {b} differ"
    assert json.loads(Path(f"{a}.json").read_text()) == json.loads(Path(f"{b}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    assert args.devices >= 1, "no GPU: this check needs one"
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-fsdp1-"))
    daemon = start_daemon(root=tmp / "root", socket=tmp / "d.sock", extra_args=["--keep-last", "0"], log_path=tmp / "daemon.log")
    try:
        base = {"address": daemon.address, "max_steps": 10, "every": 5, "batch": 4, "pause_at": 0, "fsdp1": True, "accelerator": "gpu"}
        run({**base, "job": "a", "dirpath": str(tmp / "a"), "out": str(tmp / "a.jsonl"), "ckpt_path": None, "dump": str(tmp / "a")}, args.devices)
        step5 = next((tmp / "a").glob("*-step=5.ckpt"))  # ModelCheckpoint's top-k file of step 5
        run({**base, "job": "b", "dirpath": str(tmp / "b"), "out": str(tmp / "b.jsonl"), "ckpt_path": str(step5), "dump": str(tmp / "b")}, args.devices)
        first, resumed = losses(tmp / "a.jsonl"), losses(tmp / "b.jsonl")
        assert [resumed[s] for s in range(6, 11)] == [first[s] for s in range(6, 11)], (first, resumed)
        same_state(tmp / "a", tmp / "b")
        run({**base, "job": "c", "dirpath": str(tmp / "c"), "out": str(tmp / "c.jsonl"), "ckpt_path": str(tmp / "a" / "last.ckpt"), "dump": str(tmp / "c")}, 1)
        same_state(tmp / "a", tmp / "c")
        print("OK")
    finally:
        daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
