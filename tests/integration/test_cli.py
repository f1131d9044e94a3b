"""The `ckptd` command line, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", *args], capture_output=True, text=True, timeout=60)


def test_ls_lists_committed_checkpoints(daemon) -> None:
    model = torch.nn.Linear(64, 64)
    with CheckpointClient("listed", address=daemon.address, on_error="raise") as ckpt:
        for step in (10, 20):
            ckpt.save(step, {"model": model}).wait_durable(timeout=60)
    (daemon.root / "listed" / "step-00000030").mkdir()  # uncommitted: never listed

    out = ckptd("ls", str(daemon.root), "listed")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:5] == ["JOB", "STEP", "CREATED", "SIZE", "FILES"]
    assert [line.split()[1] for line in lines[1:]] == ["10", "20"]

    rows = json.loads(ckptd("ls", str(daemon.root), "--json").stdout)
    assert [(r["job"], r["step"]) for r in rows] == [("listed", 10), ("listed", 20)]
    assert all(r["size_bytes"] > 64 * 64 * 4 and r["files"] >= 4 for r in rows)
    # without a root: the running daemon's (issue 22 item 8)
    asked = json.loads(ckptd("ls", "--address", daemon.address, "--json").stdout)
    assert asked == rows
    nobody = ckptd("ls", "--address", f"unix://{daemon.root}/none.sock")
    assert nobody.returncode == 1 and "no daemon socket" in nobody.stderr
    # a new user's probe: a job directory given as the root answered "no committed checkpoints", exit 0
    job_dir = json.loads(ckptd("ls", str(daemon.root / "listed"), "--json").stdout)
    assert job_dir == rows
    step_dir = ckptd("ls", str(daemon.root / "listed" / "step-00000010"))
    assert step_dir.returncode == 2 and "is a step directory" in step_dir.stderr and "ckptd inspect" in step_dir.stderr
    other = ckptd("ls", str(daemon.root / "listed"), "other")
    assert other.returncode == 2 and "is the directory of job 'listed'" in other.stderr
    with CheckpointClient("latest", address=daemon.address, on_error="raise") as ckpt:  # a job named like the file of a job
        ckpt.save(1, {"model": model}).wait_durable(timeout=60)
    named = json.loads(ckptd("ls", str(daemon.root), "--json").stdout)
    assert [(r["job"], r["step"]) for r in named] == [("latest", 1), ("listed", 10), ("listed", 20)]


@pytest.mark.parametrize("seconds", ["-1", "0", "nan", "inf", "soon"])
def test_status_refuses_a_watch_that_is_no_positive_number_of_seconds(seconds: str) -> None:
    out = ckptd("status", "--watch", seconds)
    assert out.returncode == 2 and "argument --watch" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("node", ["-1", "x", "1.5", "²"])
def test_verify_refuses_a_node_that_is_no_node_rank(node: str, tmp_path: Path) -> None:
    out = ckptd("verify", "--node", node, str(tmp_path))
    assert out.returncode == 2 and "argument --node" in out.stderr and "is not a node rank" in out.stderr, out.stderr


def test_ls_explains_bad_input(tmp_path: Path) -> None:
    out = ckptd("ls", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and "is not a directory" in out.stderr
    tmp_path.mkdir(exist_ok=True)
    out = ckptd("ls", str(tmp_path), "../x")
    assert out.returncode == 2 and "invalid job id" in out.stderr
    assert "no committed checkpoints" in ckptd("ls", str(tmp_path)).stdout


def test_serve_refuses_a_bad_configuration(tmp_path: Path) -> None:
    out = ckptd("serve", "--root", str(tmp_path), "--socket", str(tmp_path / "s.sock"), "--max-inflight", "zero")
    assert out.returncode == 2 and "--max-inflight" in out.stderr


def test_the_socket_is_group_accessible_only(daemon) -> None:
    import stat

    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660


def test_export_writes_a_consolidated_hugging_face_copy(daemon, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    with CheckpointClient("exported", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(3, {"model": model, "extra": {"note": 1}}).wait_durable(timeout=60)
    out = tmp_path / "hf"
    result = ckptd("export", info.step_dir, str(out))
    assert result.returncode == 0, result.stderr
    weights = load_file(out / "model-00001-of-00001.safetensors")
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["1.weight"] == "model-00001-of-00001.safetensors"

    again = ckptd("export", info.step_dir, str(out))
    assert again.returncode == 1 and "not empty" in again.stderr
    missing = ckptd("export", str(tmp_path), str(tmp_path / "x"))
    assert missing.returncode == 1 and "not a committed checkpoint" in missing.stderr
