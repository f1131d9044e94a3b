"""`ckptd import` without a daemon (ckptd.daemon.importer.importing): each source format read into a
committed step, what is refused and why, and what an import leaves behind when it fails."""

from __future__ import annotations

import json
import struct
import os
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckptd.client import tree
from ckptd.client.state import flatten_state
from ckptd.daemon.app import cli
from ckptd.daemon.importer import direct_write
from ckptd.daemon.importer import importing
from ckptd.format.index import INDEX_NAME, CheckpointIndex
from ckptd.daemon.importer.dcp import SAFE_GLOBALS, as_protocol_2, read_metadata
from ckptd.daemon.importer.state import direct_tensor, encode, map_state
from ckptd.daemon.importer.importing import ImportRefused, import_checkpoint
from ckptd.daemon.storage import Storage
from ckptd.daemon.tools.verify import verify_step


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def step_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a committed step by logical name, read from its files by the index."""
    index = CheckpointIndex.from_json_bytes((step_dir / INDEX_NAME).read_bytes())
    out = {}
    for record in index.tensors:
        (fragment,) = record.fragments
        with safe_open(str(step_dir / fragment.file), framework="pt") as f:
            out[record.name] = f.get_tensor(fragment.key)
    return out


def extras_of(step_dir: Path) -> dict:
    return json.loads((step_dir / "extra.json").read_bytes())["ranks"]["0"]


def assert_verified(step_dir: Path) -> None:
    report = verify_step(step_dir)
    assert report.ok, report


# ------------------------------------------------------------------ torch.save files


def test_a_state_dict_file_becomes_the_model_weights(tmp_path: Path) -> None:
    model = small_model()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    report = import_checkpoint(tmp_path / "w.pt", tmp_path / "root", "run", 7)

    assert report.step_dir == tmp_path / "root" / "run" / "step-00000007" and report.source_format == "torch"
    assert report.tensors == {"model": 4} and report.skipped == ()
    loaded = step_tensors(report.step_dir)
    assert sorted(loaded) == sorted(f"model/{k}" for k in model.state_dict())
    assert all(torch.equal(loaded[f"model/{k}"], v) for k, v in model.state_dict().items())
    assert (tmp_path / "root" / "run" / "latest").read_text().strip() == "step-00000007"
    assert (report.step_dir / "model.safetensors.index.json").exists()
    assert_verified(report.step_dir)


# an attacker's probe, 2026-12-01: a lazily negated view in a torch.save file ended in a traceback
def test_a_negated_view_in_a_torch_file_is_imported_with_its_values(tmp_path: Path) -> None:
    values = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save({"w": torch._neg_view(values)}, tmp_path / "neg.pt")
    report = import_checkpoint(tmp_path / "neg.pt", tmp_path / "root", "run", 1)
    assert torch.equal(step_tensors(report.step_dir)["model/w"], -values)
    assert_verified(report.step_dir)


def test_a_training_checkpoint_keeps_its_plain_values_and_says_what_it_skipped(tmp_path: Path) -> None:
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    values = {"epoch": 3, "args": {"lr": 0.1, "betas": (0.9, 0.99), "inf": float("inf")}, "ids": {1: "a"}, "tag": {"__tuple__": 1}}
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": {"w": torch.ones(3)}, **values}, tmp_path / "c.pt")
    report = import_checkpoint(tmp_path / "c.pt", tmp_path / "root", "run", 1)

    assert report.tensors == {"model": 4, "extra": 1}
    assert set(report.extras) == {"epoch", "args", "ids", "tag", "ema"}
    (skipped,) = report.skipped
    assert skipped.startswith("'optimizer': optimizer state keyed by parameter index") and "get_optimizer_state_dict" in skipped
    extras = extras_of(report.step_dir)
    loaded = step_tensors(report.step_dir)
    for key, value in values.items():
        assert tree.decode(extras[key], loaded.__getitem__) == value
    assert torch.equal(tree.decode(extras["ema"], loaded.__getitem__)["w"], torch.ones(3))


def test_optimizer_state_keyed_by_name_is_imported_in_ckptd_names(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    osd = get_optimizer_state_dict(model, opt)
    torch.save({"model": model.state_dict(), "optimizer": osd}, tmp_path / "c.pt")
    report = import_checkpoint(tmp_path / "c.pt", tmp_path / "root", "run", 1)

    assert report.tensors == {"model": 4, "optimizer": 12} and report.skipped == ()
    loaded = step_tensors(report.step_dir)
    for fqn, fields in osd["state"].items():
        for field, value in fields.items():
            assert torch.equal(loaded[f"optimizer/state/{fqn}/{field}"], value)
    saved = tree.decode(extras_of(report.step_dir)["optimizer"], loaded.__getitem__)
    assert saved["param_groups"][0]["betas"] == (0.9, 0.999) and saved["param_groups"][0]["params"] == list(osd["state"])


def test_tied_weights_are_stored_once_and_wrapper_prefixes_go(tmp_path: Path) -> None:
    embed = torch.randn(10, 4)
    state = {"module.embed.weight": embed, "module.head.weight": embed, "module.head._orig_mod.bias": torch.zeros(10)}
    torch.save(state, tmp_path / "t.pt")
    report = import_checkpoint(tmp_path / "t.pt", tmp_path / "root", "run", 1)

    index = CheckpointIndex.from_json_bytes((report.step_dir / INDEX_NAME).read_bytes())
    assert {t.name: t.aliases for t in index.tensors} == {"model/embed.weight": ("model/head.weight",), "model/head.bias": ()}
    assert any("wrapper prefixes removed" in n for n in report.notes) and any("tied" in n for n in report.notes)


class _TiedNet(torch.nn.Module):
    """Tied weights and wrappers below the top: a compiled submodule, an activation-checkpointed one."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        self.embed = torch.nn.Embedding(10, 4)
        self.block = torch.compile(torch.nn.Linear(4, 4))
        self.checkpointed = checkpoint_wrapper(torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(()))


@pytest.mark.parametrize("wrap", [lambda m: m, torch.compile], ids=["plain", "compiled"])
def test_an_imported_wrapped_model_has_the_names_and_ties_the_client_gives_it(wrap) -> None:
    model = wrap(_TiedNet())
    flat = flatten_state({"model": model}, rank=0)
    client = {e.name: e.aliases for e in flat.tensors}
    imported = {t.name: t.aliases for t in map_state({"model": model.state_dict()}, "test").tensors}
    assert imported == client
    assert client["model/embed.weight"] == ("model/head.weight",) and "model/block.weight" in client


def test_the_tensors_are_written_from_their_own_memory(tmp_path: Path) -> None:
    """No second copy: what the writer reads is the tensor's (or the mapped file's) memory."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    data = direct_tensor("model/w", "model", weight).data
    assert np.frombuffer(data, dtype=np.uint8).ctypes.data == weight.data_ptr()
    assert direct_tensor("model/w", "model", weight.T).data.tobytes() == weight.T.contiguous().numpy().tobytes()  # a copy, in C order


def test_a_legacy_file_and_a_symlinked_source_are_read(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2, 2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "link.pt").symlink_to(tmp_path / "old.pt")
    report = import_checkpoint(tmp_path / "link.pt", tmp_path / "root", "run", 1)
    assert torch.equal(step_tensors(report.step_dir)["model/w"], torch.ones(2, 2))
    assert any("legacy" in n for n in report.notes)


class Custom:
    def __init__(self) -> None:
        self.value = 1


@pytest.mark.parametrize(
    "content, expected",
    [
        (lambda p: torch.save({"model": {"w": torch.ones(1)}, "cfg": Custom()}, p), "refers to the Python global"),
        (lambda p: p.write_bytes(b""), "is empty"),
        *[(lambda p, seed=seed: p.write_bytes(random.Random(seed).randbytes(4096)), "not a torch.save file") for seed in range(8)],
        (lambda p: torch.save([torch.ones(1)], p), "holds a list, not a dict"),
        (lambda p: torch.save({"step": 3}, p), "holds no model weights"),
        (lambda p: torch.save({"w": torch.ones(2, dtype=torch.complex64)}, p), "cannot be checkpointed"),
    ],
)
def test_what_cannot_be_imported_is_refused_with_the_reason(tmp_path: Path, content, expected: str) -> None:
    content(tmp_path / "bad.pt")
    with pytest.raises(ImportRefused, match=expected) as refused:
        import_checkpoint(tmp_path / "bad.pt", tmp_path / "root", "run", 1)
    if expected == "refers to the Python global":
        assert "test_importing.Custom" in str(refused.value) and "state_dict" in str(refused.value)
    assert not (tmp_path / "root" / "run" / "step-00000001").exists()


# ------------------------------------------------------------------ the root and the step


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    torch.save({"w": torch.arange(6.0)}, tmp_path / "w.pt")
    return tmp_path / "w.pt"


def test_an_existing_step_is_never_overwritten(tmp_path: Path, weights: Path) -> None:
    root = tmp_path / "root"
    first = import_checkpoint(weights, root, "run", 5)
    before = {p.name: p.read_bytes() for p in first.step_dir.iterdir()}
    with pytest.raises(ImportRefused, match="already exists.*never overwritten"):
        import_checkpoint(weights, root, "run", 5)
    assert {p.name: p.read_bytes() for p in first.step_dir.iterdir()} == before
    (root / "run" / "step-00000006").mkdir()  # a save in progress, or one that was interrupted
    with pytest.raises(ImportRefused, match="not a committed step"):
        import_checkpoint(weights, root, "run", 6)
    assert list((root / "run" / "step-00000006").iterdir()) == []


def test_the_root_must_be_new_empty_or_a_ckptd_root(tmp_path: Path, weights: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(ImportRefused, match="holds no ckptd checkpoint"):
        import_checkpoint(weights, tmp_path / "home", "run", 1)
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]
    with pytest.raises(ImportRefused, match="is not a directory"):
        import_checkpoint(weights, weights, "run", 1)
    (tmp_path / "empty" / "lost+found").mkdir(parents=True)  # a new volume's
    import_checkpoint(weights, tmp_path / "empty", "run", 1)
    import_checkpoint(weights, tmp_path / "empty", "other", 1)  # a ckptd root now
    assert Storage(tmp_path / "empty").catalog.committed_steps("other") == [1]
    with pytest.raises(ImportRefused, match="invalid job id"):
        import_checkpoint(weights, tmp_path / "empty", "../up", 1)
    for step in (-1, 2**63, True):  # 2**63: written, pointed at by `latest`, but never a step to the daemon
        with pytest.raises(ImportRefused, match=r"step must be an integer from 0 to 2\*\*63 - 1"):
            import_checkpoint(weights, tmp_path / "empty", "run", step)
    assert Storage(tmp_path / "empty").catalog.committed_steps("run") == [1]


def test_nothing_under_the_root_is_followed_as_a_link(tmp_path: Path, weights: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    import_checkpoint(weights, root, "run", 1)
    elsewhere.mkdir()
    (root / "linked").symlink_to(elsewhere)
    with pytest.raises(ImportRefused, match="symbolic link"):
        import_checkpoint(weights, root, "linked", 1)
    (root / "run" / "latest").unlink()
    (root / "run" / "latest").symlink_to(elsewhere / "latest")
    with pytest.raises(ImportRefused, match="symbolic link"):
        import_checkpoint(weights, root, "run", 2)
    assert list(elsewhere.iterdir()) == [] and not (root / "run" / "step-00000002").exists()


@pytest.mark.parametrize("source", ["w.pt", "w.safetensors"])
def test_a_failure_midway_leaves_no_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    weights = {f"w{i}": torch.full((64, 64), float(i)) for i in range(8)}
    torch.save(weights, tmp_path / "w.pt")
    save_file(weights, str(tmp_path / "w.safetensors"))
    root = tmp_path / "root"
    import_checkpoint(tmp_path / source, root, "run", 1)
    reads = []
    real_view = direct_write.TensorArena.view

    def failing_view(self: direct_write.TensorArena, offset: int, nbytes: int) -> memoryview:
        reads.append(offset)
        if len(reads) == 5:
            raise OSError(5, "Input/output error (injected)")
        return real_view(self, offset, nbytes)

    monkeypatch.setattr(direct_write.TensorArena, "view", failing_view)
    with pytest.raises(OSError, match="injected"):
        import_checkpoint(tmp_path / source, root, "run", 2, write_threads=1)
    assert len(reads) >= 5
    storage = Storage(root)
    assert storage.catalog.committed_steps("run") == [1] and storage.catalog.latest_named("run") == 1
    assert sorted(p.name for p in (root / "run").iterdir()) == ["latest", "step-00000001"]


# ------------------------------------------------------------------ safetensors and Hugging Face


def hf_dir(tmp_path: Path, shards: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Hugging Face-style model directory with `shards` safetensors files and an index."""
    torch.manual_seed(1)
    weights = {f"layers.{i}.weight": torch.randn(4, 3).to(torch.bfloat16) for i in range(4)} | {"head.bias": torch.zeros(3)}
    directory = tmp_path / "hf"
    directory.mkdir()
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names[s::shards]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map |= {k: file for k in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 3}))
    (directory / "tokenizer.json").write_text("{}")
    return directory, weights


def test_a_sharded_hugging_face_directory_is_imported_with_its_config(tmp_path: Path) -> None:
    directory, weights = hf_dir(tmp_path, shards=3)
    report = import_checkpoint(directory, tmp_path / "root", "hf", 1)

    assert report.source_format == "hf" and report.model_files == ("config.json",) and report.tensors == {"model": 5}
    loaded = step_tensors(report.step_dir)
    assert all(torch.equal(loaded[f"model/{k}"], v) and loaded[f"model/{k}"].dtype == v.dtype for k, v in weights.items())
    assert json.loads((report.step_dir / "config.json").read_text()) == {"model_type": "toy", "hidden_size": 3}
    assert any("tokenizer.json" in n for n in report.notes)
    assert_verified(report.step_dir)


def test_a_bin_hugging_face_directory_and_a_single_safetensors_file(tmp_path: Path) -> None:
    weights = {"a.weight": torch.randn(3, 2), "b.weight": torch.randn(2)}
    directory = tmp_path / "bin"
    directory.mkdir()
    torch.save({"a.weight": weights["a.weight"]}, directory / "pytorch_model-00001-of-00002.bin")
    torch.save({"b.weight": weights["b.weight"]}, directory / "pytorch_model-00002-of-00002.bin")
    weight_map = {"a.weight": "pytorch_model-00001-of-00002.bin", "b.weight": "pytorch_model-00002-of-00002.bin"}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    report = import_checkpoint(directory, tmp_path / "root", "bin", 1)
    assert report.source_format == "hf" and any("no config.json" in n for n in report.notes)
    loaded = step_tensors(report.step_dir)
    assert all(torch.equal(loaded[f"model/{k}"], v) for k, v in weights.items())

    save_file(weights, str(tmp_path / "one.safetensors"))
    report = import_checkpoint(tmp_path / "one.safetensors", tmp_path / "root", "one", 1)
    assert report.source_format == "safetensors" and set(step_tensors(report.step_dir)) == {"model/a.weight", "model/b.weight"}


def test_a_broken_hugging_face_directory_is_refused(tmp_path: Path) -> None:
    directory, _ = hf_dir(tmp_path, shards=2)
    index = directory / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    index.write_text(json.dumps({"weight_map": {**doc["weight_map"], "extra.weight": doc["weight_map"]["head.bias"]}}))
    with pytest.raises(ImportRefused, match="incomplete"):
        import_checkpoint(directory, tmp_path / "root", "hf", 1)
    index.write_text(json.dumps({"weight_map": {"head.bias": "../elsewhere.safetensors"}}))
    with pytest.raises(ImportRefused, match="not a file of"):
        import_checkpoint(directory, tmp_path / "root", "hf", 1)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ImportRefused, match="not a safetensors file"):
        import_checkpoint(tmp_path / "bad.safetensors", tmp_path / "root", "hf", 1)
    (tmp_path / "neither").mkdir()
    with pytest.raises(ImportRefused, match="neither a Hugging Face model directory .* nor a torch.distributed.checkpoint directory"):
        import_checkpoint(tmp_path / "neither", tmp_path / "root", "hf", 1)


@pytest.mark.parametrize(
    "header, data, expected",
    [
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', 12, "'a' and 'b' overlap"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', 12, "names 'a' twice"),
        ("[]", 0, "not an object of tensors"),
    ],
)
def test_a_safetensors_file_that_is_two_things_at_once_is_refused_and_nothing_is_written(tmp_path: Path, header: str, data: int, expected: str) -> None:
    """Overlapping tensors or a key named twice: which bytes are which tensor is not clear (the
    safetensors library refuses such files); a header that is no object was a crash."""
    source = tmp_path / "polyglot.safetensors"
    source.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(data))
    with pytest.raises(ImportRefused, match=expected):
        import_checkpoint(source, tmp_path / "root", "j", 1)
    assert not (tmp_path / "root" / "j").exists()


# ------------------------------------------------------------------ DCP


def dcp_dir(tmp_path: Path, extra: dict | None = None) -> tuple[Path, torch.nn.Module, dict]:
    """A DCP directory of a small model and its AdamW state, saved by this one process."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    directory = tmp_path / "dcp"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": msd, "optimizer": osd, **(extra or {})}, checkpoint_id=directory, no_dist=True)
    return directory, model, osd


def test_a_dcp_directory_is_imported_with_its_optimizer_state(tmp_path: Path) -> None:
    directory, model, osd = dcp_dir(tmp_path, {"train": {"epoch": 2, "seen": torch.tensor([5, 6])}})
    report = import_checkpoint(directory, tmp_path / "root", "dcp", 3)

    assert report.source_format == "dcp" and report.tensors == {"model": 4, "optimizer": 12, "extra": 1}
    loaded = step_tensors(report.step_dir)
    assert all(torch.equal(loaded[f"model/{k}"], v) for k, v in model.state_dict().items())
    assert all(torch.equal(loaded[f"optimizer/state/{fqn}/{f}"], v) for fqn, fields in osd["state"].items() for f, v in fields.items())
    extras = extras_of(report.step_dir)
    assert tree.decode(extras["optimizer"], loaded.__getitem__)["param_groups"][0]["lr"] == 0.01
    train = tree.decode(extras["train"], loaded.__getitem__)
    assert train["epoch"] == 2 and torch.equal(train["seen"], torch.tensor([5, 6]))
    assert_verified(report.step_dir)


class Loader:
    """Stands for a data loader's state object: torch.save'd inside DCP as a "bytes" entry."""

    def __init__(self) -> None:
        self.position = 7


def test_a_dcp_entry_of_a_custom_class_is_skipped_not_unpickled(tmp_path: Path) -> None:
    directory, _, _ = dcp_dir(tmp_path, {"loader": Loader()})
    report = import_checkpoint(directory, tmp_path / "root", "dcp", 1)
    (skipped,) = report.skipped
    assert skipped.startswith("'loader': torch.load(weights_only=True) refuses it") and "test_importing.Loader" in skipped
    assert "loader" not in extras_of(report.step_dir)


def test_dcp_metadata_is_read_by_the_weights_only_unpickler(tmp_path: Path) -> None:
    directory, _, _ = dcp_dir(tmp_path)
    data = (directory / ".metadata").read_bytes()
    trusted = pickle.loads(data)  # the test trusts its own file: the reference
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        rewritten = torch._weights_only_unpickler.load(__import__("io").BytesIO(as_protocol_2(data)))
    assert rewritten.state_dict_metadata == trusted.state_dict_metadata
    assert rewritten.storage_data == trusted.storage_data and rewritten.planner_data == trusted.planner_data
    assert read_metadata(directory).storage_data == trusted.storage_data


def test_a_damaged_dcp_data_file_is_refused(tmp_path: Path) -> None:
    directory, _, _ = dcp_dir(tmp_path)
    data = directory / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])  # cut inside the first tensor's archive
    with pytest.raises(ImportRefused, match="cannot read the DCP checkpoint"):
        import_checkpoint(directory, tmp_path / "root", "dcp", 1)
    assert not (tmp_path / "root" / "dcp").exists()


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - the attack under test
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_dcp_metadata_file_runs_nothing(tmp_path: Path) -> None:
    directory, _, _ = dcp_dir(tmp_path)
    metadata = read_metadata(directory)
    marker = tmp_path / "pwned"
    for protocol in (2, 4, 5):
        (directory / ".metadata").write_bytes(pickle.dumps(Evil(marker), protocol=protocol))
        with pytest.raises(ImportRefused, match="without running code"):
            import_checkpoint(directory, tmp_path / "root", "dcp", 1)
    assert not marker.exists()

    holes = pickle.loads(pickle.dumps(metadata))
    holes.state_dict_metadata["model.0.weight"].size = torch.Size([9, 6])  # its one chunk covers 5 rows
    (directory / ".metadata").write_bytes(pickle.dumps(holes))
    with pytest.raises(ImportRefused, match="do not tile its size"):
        import_checkpoint(directory, tmp_path / "root", "dcp", 1)

    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../outside.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ImportRefused, match="not a plain file name"):
        import_checkpoint(directory, tmp_path / "root", "dcp", 1)
    assert not (tmp_path / "root" / "dcp").exists()


def test_a_dcp_checkpoint_larger_than_the_memory_is_refused_before_reading(tmp_path: Path) -> None:
    directory, _, _ = dcp_dir(tmp_path)
    metadata = read_metadata(directory)
    meta = metadata.state_dict_metadata["model.0.weight"]
    meta.size = meta.chunks[0].sizes = torch.Size([2**40, 6])
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ImportRefused, match="GiB of tensors and this machine has .* GiB of memory available"):
        import_checkpoint(directory, tmp_path / "root", "dcp", 1)


# ------------------------------------------------------------------ encodings and names


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": [1.5, None, True, "x"], "c": (1, (2, 3))},
        {"nan": float("nan"), "inf": float("-inf"), "bytes": b"\x00\xff"},
        {1: "int key", (2, 3): "tuple key"},
        {"__tensor__": "looks like a tag"},
        [{"deep": [[[]]]}],
    ],
)
def test_extras_are_encoded_as_the_client_decodes_them(value) -> None:
    back = tree.decode(encode(value, "extra", lambda name, tensor: None), lambda name: torch.zeros(1))
    assert repr(back) == repr(value)  # nan == nan by repr


def test_the_names_kept_apart_to_import_less_agree() -> None:
    from ckptd.daemon.importer import dcp as import_dcp

    assert cli.IMPORT_FORMATS == tuple(importing.FORMATS)
    assert importing.DCP_METADATA_NAME == import_dcp.METADATA_NAME


# ------------------------------------------------------------------ issue 30 finding 10: refusals

TORCH_ADVICE = re.compile(r"weights_only`?\s*(=|set to)\s*`?False|add_safe_globals|safe_globals|trusted source", re.I)


class Blocked:
    def __reduce__(self):  # noqa: ANN204 - never run: the global it names is refused
        return (os.system, ("true",))


class Reducer:
    def __reduce__(self):  # noqa: ANN204
        return (getattr, ("text", "upper"))


def _scripted(path: Path) -> None:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))


# issue 30 finding 10: a refused .pt names the global refused, never torch's advice to load it
# with weights_only=False (or to allow-list it).
@pytest.mark.parametrize(
    "content, named",
    [
        (lambda p: torch.save({"model": {"w": torch.ones(1)}, "cfg": Custom()}, p), "test_importing.Custom"),
        (lambda p: torch.save({"model": {"w": torch.ones(1)}, "x": Blocked()}, p), f"Python global {os.system.__module__}.system"),
        (lambda p: torch.save({"model": {"w": torch.ones(1)}, "x": Blocked()}, p, _use_new_zipfile_serialization=False), f"Python global {os.system.__module__}.system"),
        (lambda p: torch.save({"model": {"w": torch.ones(1)}, "x": Reducer()}, p), "Python global getattr "),
        (lambda p: torch.save({"model": {"w": torch.ones(1)}, "at": __import__("datetime").date(2025, 1, 2)}, p), "Python global datetime.date "),
        (_scripted, "TorchScript"),
    ],
)
def test_a_refused_torch_file_names_what_was_refused_without_torch_advice(tmp_path: Path, content, named: str) -> None:
    content(tmp_path / "bad.pt")
    with pytest.raises(ImportRefused) as refused:
        import_checkpoint(tmp_path / "bad.pt", tmp_path / "root", "run", 1)
    message = str(refused.value)
    assert named in message and not TORCH_ADVICE.search(message), message
    assert "\n" not in message and len(message) < 600
    if named != "TorchScript":
        assert "refers to the Python global" in message and "save only its tensors" in message


# issue 30 finding 10
def test_a_refused_dcp_entry_is_named_without_torch_advice(tmp_path: Path) -> None:
    directory, _, _ = dcp_dir(tmp_path, {"loader": Loader()})
    (skipped,) = import_checkpoint(directory, tmp_path / "root", "dcp", 1).skipped
    assert "refers to the Python global" in skipped and "test_importing.Loader" in skipped and not TORCH_ADVICE.search(skipped), skipped


# issue 30 finding 10: a chunk (or a "bytes" entry) that storage_data does not locate is named.
@pytest.mark.parametrize("entry", ["model.0.weight", "optimizer.param_groups.0.lr"])
def test_a_dcp_entry_without_storage_is_named_not_a_key_error(tmp_path: Path, entry: str) -> None:
    directory, _, _ = dcp_dir(tmp_path)
    metadata = read_metadata(directory)
    (key,) = [k for k in metadata.storage_data if k.fqn == entry]
    del metadata.storage_data[key]
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ImportRefused) as refused:
        import_checkpoint(directory, tmp_path / "root", "dcp", 1)
    message = str(refused.value)
    where = "chunk [0:5, 0:6] of tensor 'model.0.weight'" if entry.startswith("model") else f"entry {entry!r}"
    assert f"{where} has no storage_data entry" in message and "KeyError" not in message, message
    assert "copy the whole directory that dcp.save wrote" in message
