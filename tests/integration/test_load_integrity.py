"""Every byte a load returns is checked against the step's index, whatever the read mode: the
extras in extra.json (user values, Python's and NumPy's RNG states) as well as the tensors,
extras stored as tensors (extra.safetensors: torch's RNG state, tensor values) included. A
step whose files changed after the save fails to load with the file and step named and what
to do; an undamaged step of the same job still loads (issue 20, finding 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient, CheckpointError
from ckptd.format.index import INDEX_NAME

JOB = "integrity"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


def _save_steps(address: str, epochs: dict[int, int], rng: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """Save step s with extras {"epoch": epochs[s], "ema": a tensor}; returns each step's model weights."""
    weights = {}
    with CheckpointClient(JOB, address=address, on_error="raise") as ckpt:
        for step, epoch in epochs.items():
            model = _model(step)
            extra = {"epoch": epoch, "ema": torch.full((16,), float(epoch))}
            ckpt.save(step, {"model": model, "extra": extra}, rng=rng).wait_durable(timeout=60)
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def _step_dir(root: Path, step: int) -> Path:
    return root / JOB / f"step-{step:08d}"


def _load(address: str, read_files: bool, step: int | None = None, rng: bool = False) -> tuple[int | None, nn.Module, dict]:
    model, extra = _model(99), {"ema": torch.zeros(16)}
    with CheckpointClient(JOB, address=address, on_error="raise", read_files=read_files) as ckpt:
        got = ckpt.load({"model": model, "extra": extra}, step=step, rng=rng)
    return got, model, extra


def _assert_loads(address: str, step: int, epoch: int, weights: dict[int, dict[str, torch.Tensor]], rng: bool = False) -> None:
    for read_files in (True, False):
        got, model, extra = _load(address, read_files, step, rng)
        assert got == step
        assert extra["epoch"] == epoch and torch.equal(extra["ema"], torch.full((16,), float(epoch)))
        for name, value in model.state_dict().items():
            assert torch.equal(value, weights[step][name]), name


def _assert_refused(address: str, step: int, file: str, older: int, rng: bool = False) -> CheckpointError:
    for read_files in (True, False):
        with pytest.raises(CheckpointError) as caught:
            _load(address, read_files, step, rng)
        message = str(caught.value)
        assert file in message and f"step {step}" in message, message
        assert f"load(state, step={older})" in message or "older step" in message, message
    return caught.value


@pytest.mark.parametrize("new_epoch", ["8", "1000"], ids=["same-length", "longer"])
def test_an_edited_extra_json_fails_the_load_in_both_read_modes(daemons, new_epoch: str) -> None:
    daemon = daemons.start()
    weights = _save_steps(daemon.address, {1: 6, 2: 7, 3: 9}, rng=True)
    path = _step_dir(daemons.root, 2) / "extra.json"
    text = path.read_text()
    assert text.count('"epoch":7') == 1
    path.write_text(text.replace('"epoch":7', f'"epoch":{new_epoch}'))  # still valid JSON
    json.loads(path.read_text())

    # step 3 is in the daemon's memory; step 2 is not: its extras come from disk
    error = _assert_refused(daemon.address, 2, "extra.json", older=1, rng=True)
    assert error.code == "FAILED_PRECONDITION" and "load(state, step=1)" in str(error), str(error)
    assert "checksum" in str(error) or "bytes" in str(error), str(error)

    daemon.stop()  # a new daemon: nothing in memory, every step from disk
    daemon = daemons.start()
    error = _assert_refused(daemon.address, 2, "extra.json", older=1, rng=True)
    assert error.code == "FAILED_PRECONDITION", error.code
    _assert_loads(daemon.address, 1, 6, weights, rng=True)  # undamaged steps still load
    _assert_loads(daemon.address, 3, 9, weights, rng=True)


def test_a_missing_extra_json_fails_the_load_instead_of_losing_the_extras(daemons) -> None:
    daemon = daemons.start()
    weights = _save_steps(daemon.address, {1: 6, 2: 7})
    (_step_dir(daemons.root, 2) / "extra.json").unlink()
    daemon.stop()
    daemon = daemons.start()
    error = _assert_refused(daemon.address, 2, "extra.json", older=1)
    assert "missing" in str(error) and error.code == "FAILED_PRECONDITION", str(error)
    _assert_loads(daemon.address, 1, 6, weights)


def test_damaged_extras_stored_as_tensors_fail_the_load_in_both_read_modes(daemons) -> None:
    """extra.safetensors (tensor extras, torch's RNG state) is checked as every tensor file is."""
    daemon = daemons.start()
    weights = _save_steps(daemon.address, {1: 6, 2: 7}, rng=True)
    step_dir = _step_dir(daemons.root, 2)
    index = json.loads((step_dir / INDEX_NAME).read_text())
    fragment = index["tensors"]["extra/rank0/ema"]["fragments"][0]  # a rank's own extras tensor
    assert fragment["file"] == "extra.safetensors"
    with open(step_dir / fragment["file"], "r+b") as f:
        f.seek(fragment["offset"] + 5)
        byte = f.read(1)
        f.seek(fragment["offset"] + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    daemon.stop()
    daemon = daemons.start()
    for read_files in (True, False):
        with pytest.raises(CheckpointError) as caught:
            _load(daemon.address, read_files, 2, rng=True)
        assert "extra.safetensors" in str(caught.value) and "extra/rank0/ema" in str(caught.value), str(caught.value)
    _assert_loads(daemon.address, 1, 6, weights, rng=True)
