"""Incremental saves with a real daemon (issue 23, item 3): a fine-tune whose base weights are
frozen (requires_grad=False) and whose buffers do not move writes its frozen files once; later
steps link them. Every step stays a whole directory: loadable by ckptd in any order, by
safetensors and `ckptd verify`, through retention deleting the step that wrote the bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ckptd.client import CheckpointClient
from ckptd.format.index import INDEX_NAME
from metrics_scrape import scrape
from daemon_rig import free_port


class LoraModel(nn.Module):
    """Frozen base layers with trained low-rank adapters, and a buffer that never moves."""

    def __init__(self, width: int = 256, rank: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(rank, width) * 0.01) for _ in range(layers))
        self.up = nn.ParameterList(nn.Parameter(torch.zeros(width, rank)) for _ in range(layers))
        self.register_buffer("scale", torch.full((width,), 0.5))
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, down, up in zip(self.base, self.down, self.up):
            x = torch.tanh(base(x) + x @ down.T @ up.T) * self.scale
        return x


def _train(model: LoraModel, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, model.scale.numel())).pow(2).mean().backward()
        opt.step()


def _lora_and_adam() -> tuple[LoraModel, torch.optim.Optimizer]:
    """The same LoRA model every time, and Adam over its adapters."""
    torch.manual_seed(0)
    model = LoraModel()
    return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)


def _step_dir(root: Path, step: int) -> Path:
    return root / "job" / f"step-{step:08d}"


def test_frozen_files_are_written_once_and_every_step_loads(daemons, tmp_path: Path) -> None:
    port = free_port()
    daemon = daemons.start("--keep-last", "2", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    model, opt = _lora_and_adam()
    saved = {}
    with CheckpointClient("job", address=daemon.address, on_error="raise") as client:
        for step in (1, 2, 3):
            _train(model, opt)
            client.save(step, {"model": model, "optimizer": opt}).wait_durable(60)
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        metrics = scrape(port)
        written, linked = metrics['ckptd_written_bytes_total{job="job"}'], metrics['ckptd_linked_bytes_total{job="job"}']
        frozen_bytes = sum(p.numel() * 4 for p in model.base.parameters()) + model.scale.numel() * 4
        assert linked >= 2 * frozen_bytes  # steps 2 and 3 linked every frozen byte
        assert written < 2 * frozen_bytes  # step 1 wrote them once, adapters and optimizer are small

        # Step 1 was deleted by retention (keep 2): its bytes live on in the steps that link them.
        assert not _step_dir(daemon.root, 1).exists()
        frozen_files = [p for p in _step_dir(daemon.root, 3).glob("model-*.safetensors") if p.stat().st_nlink == 2]
        assert frozen_files, "the frozen files of step 3 are shared with step 2"
        for step in (2, 3):
            fresh = LoraModel()
            assert client.load({"model": fresh}, step=step, strict=False) == step
            assert all(torch.equal(v, saved[step][k]) for k, v in fresh.state_dict().items())
            tensors = {}
            for f in _step_dir(daemon.root, step).glob("model-*.safetensors"):
                tensors.update(load_file(f))  # every file whole, as from_pretrained reads them
            assert all(torch.equal(tensors[k], v) for k, v in saved[step].items())
            out = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "verify", str(_step_dir(daemon.root, step))], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr

        # A frozen weight changed in place (loaded again, or a bug): found by content, written.
        with torch.no_grad():
            model.base[0].weight[0, 0] += 1.0
        client.save(4, {"model": model, "optimizer": opt}).wait_durable(60)
        index = json.loads((_step_dir(daemon.root, 4) / INDEX_NAME).read_text())
        holder = index["tensors"]["model/base.0.weight"]["fragments"][0]["file"]
        assert (_step_dir(daemon.root, 4) / holder).stat().st_nlink == 1
        fresh = LoraModel()
        client.load({"model": fresh}, step=4, strict=False)
        assert torch.equal(fresh.base[0].weight, model.base[0].weight)
        assert (_step_dir(daemon.root, 3) / holder).exists()  # step 3's own file is untouched
        fresh3 = LoraModel()
        client.load({"model": fresh3}, step=3, strict=False)
        assert torch.equal(fresh3.base[0].weight, saved[3]["base.0.weight"])


def test_incremental_saves_can_be_turned_off(daemons) -> None:
    daemon = daemons.start("--no-link-unchanged")
    model = LoraModel(width=32)
    with CheckpointClient("job", address=daemon.address, on_error="raise") as client:
        for step in (1, 2):
            client.save(step, {"model": model}).wait_durable(60)
    assert all(p.stat().st_nlink == 1 for p in _step_dir(daemon.root, 2).glob("*.safetensors"))


@pytest.mark.parametrize("shared_root", [True, False], ids=["shared-root", "node-local-roots"])
def test_two_nodes_link_their_own_unchanged_files(node_sets, shared_root: bool) -> None:
    """Each node links the frozen files it wrote at the previous step (in a shared root or its
    own), and every step loads bit-exact through either node after retention removed the first."""
    cluster = node_sets(2, shared_root=shared_root)
    cluster.start_all("--keep-last", "2")
    torch.manual_seed(0)
    model = LoraModel(width=128, layers=4)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    clients = [
        CheckpointClient("job", address=cluster.address(n), rank=n, world_size=2, local_world_size=1, on_error="raise", timeout_s=60)
        for n in range(2)
    ]
    saved = {}
    try:
        with ThreadPoolExecutor(2) as pool:
            for step in (1, 2, 3):
                _train(model, opt)
                state = {"model": model, "optimizer": opt}
                list(pool.map(lambda c: c.save(step, state).wait_durable(60), clients))
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        roots = [cluster.root(0)] if shared_root else [cluster.root(0), cluster.root(1)]
        index = json.loads((_step_dir(cluster.root(0), 3) / INDEX_NAME).read_text())
        frozen_files = {f["file"] for name, t in index["tensors"].items() if name.startswith("model/base") for f in t["fragments"]}
        for name in frozen_files:
            holder = next(r for r in roots if (_step_dir(r, 3) / name).exists())
            assert (_step_dir(holder, 3) / name).stat().st_ino == (_step_dir(holder, 2) / name).stat().st_ino, name
        assert not _step_dir(cluster.root(0), 1).exists()
        for n in range(2):
            with CheckpointClient("job", address=cluster.address(n), rank=0, world_size=1, local_world_size=1, on_error="raise") as one:
                for step in (2, 3):
                    fresh = LoraModel(width=128, layers=4)
                    assert one.load({"model": fresh}, step=step, strict=False) == step
                    assert all(torch.equal(v, saved[step][k]) for k, v in fresh.state_dict().items())
    finally:
        for c in clients:
            c.close()


def _flip(path: Path, at: int, replace: bool) -> None:
    """Damage a data file on disk: flip the byte at `at` in place (every hard link of the file
    sees it), or put a same-size copy with that byte flipped in its place (a new file)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    if replace:
        other = path.with_name(path.name + ".new")
        other.write_bytes(bytes(data))
        other.replace(path)
    else:
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(bytes([data[at]]))


# issue 30 finding 2: a frozen file damaged on disk after it was committed is never linked into
# later steps; every acknowledged step loads bit-exact after a restart (no help from memory).
@pytest.mark.parametrize("replace", [False, True], ids=["flipped-byte", "same-size-replacement"])
def test_a_frozen_file_damaged_on_disk_is_written_again_and_every_acknowledged_step_loads_after_a_restart(daemons, replace: bool) -> None:
    port = free_port()
    daemon = daemons.start("--keep-last", "2", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    model, opt = _lora_and_adam()
    saved = {}
    with CheckpointClient("job", address=daemon.address, on_error="raise") as client:
        _train(model, opt)
        client.save(1, {"model": model, "optimizer": opt}).wait_durable(60)
        saved[1] = {k: v.clone() for k, v in model.state_dict().items()}
        index = json.loads((_step_dir(daemon.root, 1) / INDEX_NAME).read_text())
        fragment = index["tensors"]["model/base.1.weight"]["fragments"][0]
        damaged = fragment["file"]
        _flip(_step_dir(daemon.root, 1) / damaged, fragment["offset"] + fragment["nbytes"] // 2, replace)
        for step in (2, 3):  # step 3: retention removes step 1, the only other copy of the good bytes is gone
            _train(model, opt)
            client.save(step, {"model": model, "optimizer": opt}).wait_durable(60)
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        mismatches = scrape(port).get('ckptd_link_mismatches_total{job="job"}')
    assert not _step_dir(daemon.root, 1).exists()
    log = daemon.log_text()
    daemon.stop()

    restarted = daemons.start()  # nothing held in memory: every load reads the files
    with CheckpointClient("job", address=restarted.address, on_error="raise") as client:
        for step in (2, 3):
            fresh = LoraModel()
            assert client.load({"model": fresh}, step=step, strict=False) == step
            assert all(torch.equal(v, saved[step][k]) for k, v in fresh.state_dict().items())
            out = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "verify", str(_step_dir(restarted.root, step))], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
    assert mismatches == 1  # step 2 found it; step 3 linked step 2's good copy
    assert f"step 2 of job job: {damaged}, linked from step 1" in log and "damaged on disk" in log
    assert (_step_dir(restarted.root, 3) / damaged).stat().st_nlink == 2  # linked again once good: steps 2 and 3 share it


# issue 30 finding 11: DurableInfo reports the bytes written and the bytes linked apart.
def test_durable_info_reports_written_and_linked_bytes_apart(daemons) -> None:
    daemon = daemons.start()
    model, opt = _lora_and_adam()
    frozen_bytes = sum(p.numel() * 4 for p in model.base.parameters()) + model.scale.numel() * 4
    with CheckpointClient("job", address=daemon.address, on_error="raise") as client:
        _train(model, opt)
        first = client.save(1, {"model": model, "optimizer": opt}).wait_durable(60)
        _train(model, opt)
        second = client.save(2, {"model": model, "optimizer": opt}).wait_durable(60)
    assert first.bytes_linked == 0 and first.bytes_written >= frozen_bytes
    # the files' bytes: the frozen tensors' file (its safetensors header too) linked, not written again
    assert frozen_bytes < second.bytes_linked < frozen_bytes + 4096
    assert second.bytes_written == first.bytes_written - second.bytes_linked  # only the adapters and the optimizer
    files = sorted(_step_dir(daemon.root, 1).glob("*.safetensors"))
    assert first.bytes_written == sum(f.stat().st_size for f in files)


def test_durable_info_of_a_compressed_step_counts_the_bytes_its_files_take(daemons) -> None:
    """Found by a new user's probe: a step saved with quantize="O2", master_weights="drop" reported
    the bytes of the snapshot (165,128) where its files hold 47,490 (the probe's figures): the writer's progress counts
    what it has consumed; the committed step reports what its files take."""
    daemon = daemons.start()
    model, opt = _lora_and_adam()
    with CheckpointClient("packed", address=daemon.address, on_error="raise") as client:
        _train(model, opt)
        plain = client.save(1, {"model": model, "optimizer": opt}, quantize="none").wait_durable(60)
        packed = client.save(2, {"model": model, "optimizer": opt}, quantize="O2").wait_durable(60)
    for info in (plain, packed):
        files = sorted(Path(info.step_dir).glob("*.safetensors"))
        assert info.bytes_written + info.bytes_linked == sum(f.stat().st_size for f in files), info
    assert packed.bytes_written < plain.bytes_written
