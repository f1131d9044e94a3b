"""`ckptd import` refuses a hostile source quickly and clearly (issue 30 finding 10): links out of
the source directory (a Hugging Face cache's links into its blobs/ aside), FIFOs and devices
where files belong (a FIFO blocked `ckptd import` for ever)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

from ckptd.daemon.importer.source import read_source
from ckptd.daemon.importer.importing import ImportRefused, import_checkpoint

WAIT_S = 30  # far more than a refusal takes; a read blocked on a FIFO never ends


def refusal(run: Callable[[], object], fifos: tuple[Path, ...] = ()) -> str:
    """The ImportRefused message `run` ends with, in a thread: a read that blocks on one of
    `fifos` is released (a writer opens it) and fails the test."""
    outcome: list[BaseException | object] = []

    def target() -> None:
        try:
            outcome.append(run())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(WAIT_S)
    blocked = worker.is_alive()
    for fifo in fifos if blocked else ():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            continue  # nobody waits on this one
    worker.join(WAIT_S)
    assert not blocked, "the import blocked reading a FIFO"
    (result,) = outcome
    assert isinstance(result, ImportRefused), result
    return str(result)


def hf_directory(directory: Path) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True)
    weights = {"embed.weight": torch.arange(12.0).reshape(4, 3), "head.bias": torch.ones(3)}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return weights


def dcp_directory(directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.ones(4, 4)}, "step": 3}, checkpoint_id=directory, no_dist=True)


def replace_with_link(path: Path, target: Path) -> None:
    path.rename(target)
    path.symlink_to(target)


def replace_with_fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


# issue 30 finding 10
@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_link_out_of_a_hugging_face_directory_is_refused(tmp_path: Path, name: str) -> None:
    source = tmp_path / "hf"
    hf_directory(source)
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    replace_with_link(source / name, secret)
    message = refusal(lambda: import_checkpoint(source, tmp_path / "root", "run", 1))
    assert f"{source / name} is a symbolic link to {secret}, outside the source directory" in message
    assert "cp --remove-destination" in message
    assert not (tmp_path / "root" / "run").exists()


# issue 30 finding 10
def test_a_link_out_of_a_dcp_directory_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "dcp"
    dcp_directory(source)
    (data,) = source.glob("*.distcp")
    replace_with_link(data, tmp_path / "elsewhere.distcp")
    message = refusal(lambda: import_checkpoint(source, tmp_path / "root", "run", 1))
    assert f"{data} is a symbolic link to {tmp_path / 'elsewhere.distcp'}, outside the source directory" in message


# issue 30 finding 10: links that stay inside the directory, and a Hugging Face hub cache's
# snapshot links into its own blobs/, are followed.
def test_links_inside_the_directory_and_into_a_hub_cache_blobs_are_followed(tmp_path: Path) -> None:
    inside = tmp_path / "hf"
    hf_directory(inside)
    (inside / "shards").mkdir()
    replace_with_link(inside / "model.safetensors", inside / "shards" / "real.safetensors")
    report = import_checkpoint(inside, tmp_path / "root", "inside", 1)
    assert report.tensors == {"model": 2}

    entry = tmp_path / "hub" / "models--org--toy"
    snapshot = entry / "snapshots" / "0123abcd"
    hf_directory(tmp_path / "downloaded")
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (tmp_path / "downloaded" / name).rename(entry / "blobs" / f"hash-{name}")
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / f"hash-{name}")
    report = import_checkpoint(snapshot, tmp_path / "root", "hub", 1)
    assert report.tensors == {"model": 2} and report.model_files == ("config.json",)
    step = import_checkpoint(snapshot / "model.safetensors", tmp_path / "root", "hub-file", 1)  # SOURCE itself a link
    assert step.tensors == {"model": 2}

    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (snapshot / "config.json").rename(other / "hash-config.json")
    (snapshot / "config.json").symlink_to(other / "hash-config.json")  # another entry's blob
    message = refusal(lambda: import_checkpoint(snapshot, tmp_path / "root", "hub", 2))
    assert "outside the source directory" in message


# issue 30 finding 10: a FIFO where a file belongs is refused without being opened for reading.
@pytest.mark.parametrize(
    "layout, fifo",
    [
        ("torch", "w.pt"), ("safetensors", "w.safetensors"), ("hf", "hf/config.json"), ("hf", "hf/model.safetensors"),
        ("dcp", "dcp/.metadata"), ("dcp", "dcp/__0_0.distcp"),
    ],
)
def test_a_fifo_is_refused_not_read(tmp_path: Path, layout: str, fifo: str) -> None:
    if layout == "hf":
        hf_directory(tmp_path / "hf")
    elif layout == "dcp":
        dcp_directory(tmp_path / "dcp")
    else:
        (tmp_path / fifo).write_bytes(b"")
    path = replace_with_fifo(tmp_path / fifo)
    source = tmp_path / fifo.split("/")[0]
    message = refusal(lambda: import_checkpoint(source, tmp_path / "root", "run", 1, source_format=layout), (path,))
    assert f"{path} is a FIFO, not a regular file" in message and "put the file it stands for in its place" in message


# issue 30 finding 10
@pytest.mark.parametrize("source_format", ["auto", "torch", "safetensors"])
def test_a_device_is_refused_not_read(tmp_path: Path, source_format: str) -> None:
    message = refusal(lambda: import_checkpoint("/dev/zero", tmp_path / "root", "run", 1, source_format=source_format))
    assert "/dev/zero is a device, not a regular file" in message


# issue 30 finding 10: the command line, as `ckptd import` hung on a DCP directory with a FIFO.
def test_ckptd_import_of_a_directory_with_a_fifo_exits_at_once(tmp_path: Path) -> None:
    dcp_directory(tmp_path / "dcp")
    fifo = replace_with_fifo(tmp_path / "dcp" / "__0_0.distcp")
    command = [sys.executable, "-m", "ckptd.daemon.app.cli", "import", str(tmp_path / "dcp"), "--root", str(tmp_path / "root"), "--job", "run", "--step", "1"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("ckptd import blocked on the FIFO")
    assert done.returncode == 1 and f"{fifo} is a FIFO, not a regular file" in done.stderr
    assert not (tmp_path / "root" / "run").exists()


# issue 30 finding 10
def test_a_format_that_does_not_fit_the_source_is_refused(tmp_path: Path) -> None:
    hf_directory(tmp_path / "hf")
    with pytest.raises(ImportRefused, match=r"--format torch reads a torch.save file, and .* is a directory"):
        import_checkpoint(tmp_path / "hf", tmp_path / "root", "run", 1, source_format="torch")
    with pytest.raises(ImportRefused, match=r"--format dcp reads a torch.distributed.checkpoint directory, and .* is a file"):
        import_checkpoint(tmp_path / "hf" / "model.safetensors", tmp_path / "root", "run", 1, source_format="dcp")


# issue 30 review: read_source reads as storage's read_file does, with the import's refusals
def test_read_source_refuses_a_file_larger_than_its_limit_and_one_swapped_for_a_fifo(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"{}" * 8)
    assert read_source(path, 16) == b"{}" * 8
    with pytest.raises(ImportRefused, match=f"{path} is larger than the 15 bytes ckptd reads of such a file"):
        read_source(path, 15)
    path.unlink()
    os.mkfifo(path)  # swapped after the checks on the path: refused on the descriptor, not waited on
    assert "is a FIFO, not a regular file" in refusal(lambda: read_source(path, 16), (path,))
