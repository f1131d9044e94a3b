"""`ckptd import` as a user runs it, for each source format: make the source, import it with the
command line (no daemon running), check it with `ckptd verify`, then start a real daemon on the
root and load the step with 2 gloo ranks into DTensor Shard(0)-sharded parameters: every tensor
equal, bit for bit, to the source's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from worker_process import run_ranks  # tests/worker_process.py

HERE = Path(__file__).parent
LOAD_RANK = HERE / "import_load_rank.py"
DCP_RANK = HERE / "import_dcp_rank.py"


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", *args], capture_output=True, text=True, timeout=120)


def import_and_verify(source: Path, root: Path, job: str, step: int) -> dict:
    out = ckptd("import", str(source), "--root", str(root), "--job", job, "--step", str(step), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    step_dir = Path(report["step_dir"])
    assert step_dir == root / job / f"step-{step:08d}"
    verified = ckptd("verify", str(step_dir))
    assert verified.returncode == 0 and "OK:" in verified.stdout, verified.stdout + verified.stderr
    return report


def load_sharded(daemons, tmp: Path, job: str, step: int, reference: Path, **spec: object) -> list[dict]:
    """Start a daemon on the root and load the step with 2 gloo ranks (Shard(0) parameters)."""
    daemon = daemons.start()
    out = tmp / f"loaded-{job}"
    out.mkdir()
    run_ranks(LOAD_RANK, 2, address=daemon.address, job=job, step=step, reference=str(reference), out=str(out), **spec)
    results = [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]
    names = set(load_file(str(reference)))
    for result in results:
        assert result["step"] == step and result["placements"] == ["(Shard(dim=0),)"]
        assert all(result["exact"].values()), {k: v for k, v in result["exact"].items() if not v}
        assert set(result["exact"]) == names
    return results


@pytest.mark.slow
def test_a_torch_save_file(daemons, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    torch.save({"model": model.state_dict(), "epoch": 3}, tmp_path / "model.pt")
    save_file({f"model/{k}": v for k, v in model.state_dict().items()}, str(tmp_path / "reference.safetensors"))

    report = import_and_verify(tmp_path / "model.pt", daemons.root, "torch-save", 100)
    assert report["format"] == "torch" and report["tensors"] == {"model": 4} and report["extras"] == ["epoch"]
    again = ckptd("import", str(tmp_path / "model.pt"), "--root", str(daemons.root), "--job", "torch-save", "--step", "100")
    assert again.returncode == 1 and "never overwritten" in again.stderr
    load_sharded(daemons, tmp_path, "torch-save", 100, tmp_path / "reference.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["safetensors", pytest.param("bin", marks=pytest.mark.long)])
def test_a_hugging_face_model_directory(daemons, tmp_path: Path, weights: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    source = tmp_path / "hf"
    if weights == "safetensors":
        model.save_pretrained(source, max_shard_size="20KB")  # several shards and an index
        assert len(list(source.glob("model-*.safetensors"))) > 2
    else:  # transformers 5 writes safetensors only: the .bin layout written as older versions did
        source.mkdir()
        model.config.save_pretrained(source)
        torch.save(model.state_dict(), source / "pytorch_model.bin")
    save_file({f"model/{k}": v for k, v in model.state_dict().items()}, str(tmp_path / "reference.safetensors"))

    report = import_and_verify(source, daemons.root, f"hf-{weights}", 1)
    assert report["format"] == "hf" and "config.json" in report["model_files"]
    step_dir = Path(report["step_dir"])
    loaded = transformers.LlamaForCausalLM.from_pretrained(step_dir).eval()
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    load_sharded(daemons, tmp_path, f"hf-{weights}", 1, tmp_path / "reference.safetensors", hf_config=str(step_dir))


@pytest.mark.slow
def test_a_dcp_directory_written_by_two_ranks(daemons, tmp_path: Path) -> None:
    source, reference = tmp_path / "dcp", tmp_path / "reference.safetensors"
    run_ranks(DCP_RANK, 2, out=str(source), reference=str(reference))
    assert len(list(source.glob("*.distcp"))) == 2

    report = import_and_verify(source, daemons.root, "dcp", 20)
    assert report["format"] == "dcp" and report["tensors"] == {"model": 4, "optimizer": 12}
    assert sorted(report["extras"]) == ["optimizer", "train"]
    results = load_sharded(daemons, tmp_path, "dcp", 20, reference, optimizer=True)
    assert all(r["lr"] == 0.01 for r in results)  # the saved param_groups, not the loader's lr=0.5


CRASH = HERE / "import_crash.py"


def killed_import(source: Path, root: Path, job: str, step: int, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    command = [sys.executable, str(CRASH), str(source), str(root), job, str(step)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **env})


@pytest.mark.slow
def test_an_import_killed_at_any_point_leaves_no_step_or_a_whole_one(daemons, tmp_path: Path) -> None:
    """SIGKILL before each of a few file events (faults.py): until the index is renamed into
    place no step is visible; after it, the step is whole; the daemon removes the leftovers."""
    import shutil

    from ckptd.daemon.importer.importing import import_checkpoint
    from ckptd.daemon.storage import Storage

    torch.save({f"w{i}": torch.full((128, 128), float(i)) for i in range(4)}, tmp_path / "w.pt")
    root = daemons.root
    import_checkpoint(tmp_path / "w.pt", root, "crash", 1)  # the step before the kills; the command line is test_a_torch_save_file's
    shutil.copytree(root, tmp_path / "probe")
    events = tmp_path / "events.jsonl"
    assert killed_import(tmp_path / "w.pt", tmp_path / "probe", "crash", 10, CKPTD_FAULT_LOG=str(events)).returncode == 0
    kinds = [json.loads(line) for line in events.read_text().splitlines()]
    commit = next(e["n"] for e in kinds if e["kind"] == "rename" and "/.tmp-ckptd.index.json" in e["path"])

    for step, kill_at in zip((10, 11, 12, 13), (1, commit // 2, commit, commit + 1)):
        out = killed_import(tmp_path / "w.pt", root, "crash", step, CKPTD_FAULT_KILL_AT=str(kill_at))
        assert out.returncode == -9, out.stderr
        committed = Storage(root).catalog.committed_steps("crash")
        assert committed == ([1, step] if kill_at > commit else [1]), (kill_at, committed)
    assert ckptd("verify", str(root / "crash" / "step-00000013")).returncode == 0

    daemons.start()  # start-up recovery: leftovers of the killed imports go, `latest` names the newest
    assert sorted(p.name for p in (root / "crash").iterdir()) == ["latest", "step-00000001", "step-00000013"]
    assert (root / "crash" / "latest").read_text().strip() == "step-00000013"
