"""Compressed checkpoints through a real daemon (issue 4): O1/O2 optimizer moments, master
weights dropped or stored as residuals, resharded loads, the compounding guard, `ckptd inspect`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from ckptd.client import CheckpointClient, CheckpointError
from ckptd.client.layout import LayoutRules, RankCoords, Rule, Split
from ckptd.common import codecs, frames
from ckptd.common.boxes import Box
from ckptd.format.index import INDEX_NAME, INDEX_FORMAT_QUANT, CheckpointIndex
from ckptd.demo.process import DaemonProcess


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(96, 300)  # 28800 weights: quantized; bias (1-D): lossless
        self.down = nn.Linear(300, 96)
        self.norm = nn.LayerNorm(96)
        self.small = nn.Linear(16, 16)  # 256 elements: lossless

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(self.norm(self.down(torch.relu(self.up(x))))[..., :16])


def trained(seed: int = 0, steps: int = 5) -> tuple[Mlp, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(torch.randn(8, 96)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def fresh() -> tuple[Mlp, torch.optim.Optimizer]:
    return trained(seed=123, steps=1)


def opt_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def index_of(daemon, job: str, step: int) -> CheckpointIndex:
    path = daemon.root / job / f"step-{step:08d}" / INDEX_NAME
    return CheckpointIndex.from_json_bytes(path.read_bytes())


@pytest.mark.parametrize("scheme", ["O1", "O2"])
def test_quantized_save_loads_within_the_error_bounds(daemon, scheme: str) -> None:
    model, opt = trained()
    job = f"q-{scheme}"
    with CheckpointClient(job, address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt}, quantize=scheme).wait_durable(timeout=60)
        m2, o2 = fresh()
        assert ckpt.load({"model": m2, "optimizer": o2}) == 5  # from the files: lossy tensors never come from memory
    for (n, a), (_, b) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n  # model weights are never quantized
    saved, loaded = opt_state(model, opt), opt_state(m2, o2)
    first, second = codecs.codec_for(scheme, "x/exp_avg", "optimizer", "F32", (300, 96)), codecs.codec_for(scheme, "x/exp_avg_sq", "optimizer", "F32", (300, 96))
    for name in saved:
        a, b = saved[name], loaded[name]
        assert torch.equal(a["step"], b["step"])
        big = a["exp_avg"].dim() >= 2 and a["exp_avg"].numel() > 4096
        if not big:
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]), name
            continue
        assert not torch.equal(a["exp_avg"], b["exp_avg"])
        assert float((a["exp_avg"] - b["exp_avg"]).abs().max()) <= float(a["exp_avg"].abs().max()) / (2 * first.levels) * 1.001
        assert bool(((b["exp_avg_sq"] > 0) == (a["exp_avg_sq"] > 0)).all())
        nz = a["exp_avg_sq"] > 0
        assert float((b["exp_avg_sq"][nz].log2() - a["exp_avg_sq"][nz].log2()).abs().max()) < (2.5 if second.bits == 4 else 0.3)
    index = index_of(daemon, job, 5)
    raw = json.loads((daemon.root / job / "step-00000005" / INDEX_NAME).read_bytes())
    assert raw["format"] == INDEX_FORMAT_QUANT and index.quantization == {"generation": 1, "quantize": scheme, "master_weights": "keep"}
    record = index.by_name()["optimizer/state/up.weight/exp_avg_sq"]
    frag = record.fragments[0]
    assert frag.quant is not None and frag.quant.codec == second.name and frag.quant.block == second.block
    assert frag.dtype == "U8" and frag.quant.scales is not None and frag.quant.scales.key.endswith("@scales")
    # the files stay plain safetensors: int8 codes as they are; int4 codes in zstd frames of whole
    # rows (read by any tool as bytes), which decompress to the codes of the whole tensor
    with safe_open(str(daemon.root / job / "step-00000005" / frag.file), "pt") as f:
        stored = f.get_tensor(frag.key)
        assert tuple(f.get_tensor(frag.quant.scales.key).shape) == second.scales_shape(Box.full((300, 96)))
    assert index.by_name()["optimizer/state/up.bias/exp_avg"].fragments[0].quant is None
    if second.bits == 8:
        assert frag.quant.frames is None and tuple(stored.shape) == second.codes_shape((300, 96))
        return
    assert stored.dtype == torch.uint8 and tuple(stored.shape) == (frag.nbytes,)
    table = frag.quant.frames
    assert table is not None and table.nbytes == frag.nbytes
    row_bytes = second.codes_shape((300, 96))[1]
    codes = frames.decompress(stored.numpy(), table, 0, len(table.ends), row_bytes, 300)
    assert len(codes) == 300 * row_bytes
    assert frag.nbytes < len(codes)  # the entropy coder takes bytes off


@pytest.mark.parametrize("dim, parts", [(0, 3), (1, 3)])
def test_resharded_load_equals_the_whole_tensor_sliced(daemon, dim: int, parts: int) -> None:
    """Saved whole, loaded by tensor-parallel ranks splitting rows or columns (99 columns over 3:
    offsets 33 and 66, odd, inside int4 bytes and inside blocks): every rank's slice equals the
    same slice of a whole-tensor load."""
    g = torch.Generator().manual_seed(3)
    m = torch.randn(300, 99, generator=g) * 1e-3
    v = (torch.randn(300, 99, generator=g) * 1e-3) ** 2
    job = f"reshard-{dim}-{parts}"
    with CheckpointClient(job, address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"optimizer": {"state": {"w": {"exp_avg": m, "exp_avg_sq": v}}}}, quantize="O2").wait_durable(timeout=60)
        whole = {"exp_avg": torch.empty(300, 99), "exp_avg_sq": torch.empty(300, 99)}
        ckpt.load({"optimizer": {"state": {"w": whole}}})
    assert not torch.equal(whole["exp_avg"], m) and float((whole["exp_avg"] - m).abs().max()) < float(m.abs().max()) / 14 * 1.001
    rules = LayoutRules([Rule(r"w", Split(dim=dim))])
    for rank in range(parts):
        with CheckpointClient(job, address=daemon.address, on_error="raise", rank=rank, world_size=parts, layout=rules, coords=RankCoords(rank, parts)) as client:
            mine = {f: t.tensor_split(parts, dim)[rank].clone().zero_() for f, t in whole.items()}
            client.load({"optimizer": {"state": {"w": mine}}})
        for field in mine:
            assert torch.equal(mine[field], whole[field].tensor_split(parts, dim)[rank]), (field, rank)


def test_damaged_scales_are_found_by_verify_and_by_a_resharded_load(daemon) -> None:
    """Scale tensors carry checksums of their own (whole and per chunk): `ckptd verify` and a
    load that reads only some rows of them (chunk checksums) or all of them (the whole
    checksum, hashed as they are read) find a flipped byte."""
    g = torch.Generator().manual_seed(5)
    m = torch.randn(300, 1024, generator=g) * 1e-3
    with CheckpointClient("bad-scales", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"optimizer": {"state": {"w": {"exp_avg": m}}}}, quantize="O1").wait_durable(timeout=60)
    step_dir = daemon.root / "bad-scales" / "step-00000001"
    scales = index_of(daemon, "bad-scales", 1).by_name()["optimizer/state/w/exp_avg"].fragments[0].quant.scales
    assert scales is not None and scales.chunk_bytes and scales.chunk_xxh3
    with open(step_dir / scales.file, "r+b") as f:  # the last row's scales: read only by the last rank
        f.seek(scales.offset + scales.nbytes - 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    verify = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "verify", str(step_dir)], capture_output=True, text=True)
    assert verify.returncode != 0 and "@scales" in verify.stdout and "does not match its checksum" in verify.stdout, verify.stdout
    rules = LayoutRules([Rule(r"w", Split(dim=0))])
    with CheckpointClient("bad-scales", address=daemon.address, on_error="raise", rank=2, world_size=3, layout=rules, coords=RankCoords(2, 3)) as client:
        with pytest.raises(CheckpointError, match="checksum"):
            client.load({"optimizer": {"state": {"w": {"exp_avg": torch.empty(100, 1024)}}}})
    with CheckpointClient("bad-scales", address=daemon.address, on_error="raise") as client:
        with pytest.raises(CheckpointError, match="checksum mismatch for tensor 'optimizer/state/w/exp_avg'"):
            client.load({"optimizer": {"state": {"w": {"exp_avg": torch.empty(300, 1024)}}}})


def test_client_reads_any_slice_like_the_whole(daemon) -> None:
    """The client's decode path directly: a PlanLoad piece read for sub-boxes (odd column
    offsets, row ranges) equals the whole decoded tensor sliced."""
    from ckptd.client.arenas import ArenaMaps
    from ckptd.client.reader.pieces import Decoding, Source
    from ckptd.client.reader.fill import Fill, fill_all
    from concurrent.futures import ThreadPoolExecutor

    model, opt = trained()
    with CheckpointClient("slices", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt}, quantize="O2").wait_durable(timeout=60)
    index = index_of(daemon, "slices", 5)
    step_dir = daemon.root / "slices" / "step-00000005"
    with ThreadPoolExecutor(2) as pool:
        for field in ("exp_avg", "exp_avg_sq"):
            frag = index.by_name()[f"optimizer/state/up.weight/{field}"].fragments[0]
            assert frag.quant is not None and frag.quant.scales is not None
            sc = frag.quant.scales
            src = Source(
                "t", "file", str(step_dir / frag.file), frag.offset, frag.nbytes, frag.box, frag.dtype, frag.checksum,
                decode=Decoding(
                    frag.quant.codec, frag.quant.block, Source("t", "file", str(step_dir / sc.file), sc.offset, sc.nbytes, frag.box, sc.dtype, sc.checksum),
                    None, frag.quant.frames,
                ),
            )
            whole = torch.empty(300, 96)
            fill_all(pool, ArenaMaps(), [Fill(whole, Box.full((300, 96)), [src])])
            for want in (Box((0, 0), (100, 96)), Box((100, 1), (101, 47)), Box((7, 33), (1, 1)), Box((299, 95), (1, 1)), Box((5, 48), (50, 48))):
                part = torch.empty(want.lengths)
                fill_all(pool, ArenaMaps(), [Fill(part, want, [src])])
                sl = tuple(slice(o, o + n) for o, n in zip(want.offsets, want.lengths))
                assert torch.equal(part, whole[sl]), (field, want)


def mixed_precision(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor], torch.optim.Optimizer]:
    """bf16 model weights, fp32 master weights (what the optimizer steps), Adam."""
    torch.manual_seed(seed)
    model = Mlp()
    master = {n: p.detach().clone().float().requires_grad_(True) for n, p in model.named_parameters()}
    model = model.to(torch.bfloat16)
    opt = torch.optim.Adam(list(master.values()), lr=1e-3)
    for _ in range(3):
        for p in master.values():
            p.grad = torch.randn_like(p) * 1e-2
        opt.step()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(master[n])
    return model, {n: t.detach() for n, t in master.items()}, opt


@pytest.mark.parametrize("mode", ["drop", "residual"])
def test_master_weights_drop_and_residual(daemon, mode: str) -> None:
    model, master, _ = mixed_precision()
    job = f"master-{mode}"
    with CheckpointClient(job, address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(3, {"model": model, "master": master}, master_weights=mode).wait_durable(timeout=60)
        m2, master2, _ = mixed_precision(seed=9)
        ckpt.load({"model": m2, "master": master2})
    step_dir = daemon.root / job / "step-00000003"
    index = index_of(daemon, job, 3)
    assert index.quantization is not None and index.quantization["master_weights"] == mode
    for name, want in master.items():
        got = master2[name]
        rel = float(((got - want).abs() / want.abs().clamp(min=1e-12)).max())
        if mode == "drop":
            assert torch.equal(got, model.state_dict()[name].float())
            assert rel < 2**-8
        else:
            assert rel < 2**-15, name
    master_files = sorted(p.name for p in step_dir.glob("master_weights-*"))
    record = index.by_name()["master/up.weight"].fragments[0]
    if mode == "drop":
        assert master_files == [] and record.quant is not None and record.quant.codec == "cast" and record.file.startswith("model-")
        assert index.quantization["generation"] == 1
    else:
        assert master_files and record.dtype == "BF16" and record.quant is not None and record.quant.base is not None
        assert index.quantization["generation"] == 0  # a residual is near exact: not a lossy cycle


def test_generation_guard_saves_losslessly_after_a_lossy_resume(daemons) -> None:
    daemon = daemons.start("--quantize", "O2", "--keep-last", "0")  # the job's default: quantize every save
    model, opt = trained()
    with CheckpointClient("guard", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
        assert index_of(daemon, "guard", 1).quantization == {"generation": 1, "quantize": "O2", "master_weights": "keep"}
        ckpt.save(2, {"model": model, "optimizer": opt}, quantize="none").wait_durable(timeout=60)
        assert index_of(daemon, "guard", 2).quantization is None  # asked for lossless, no lossy lineage
    daemon.stop()
    daemon = daemons.start("--quantize", "O2", "--keep-last", "0")
    with CheckpointClient("guard", address=daemon.address, on_error="raise") as ckpt:
        m2, o2 = fresh()
        assert ckpt.load({"model": m2, "optimizer": o2}, step=1) == 1
        ckpt.save(3, {"model": m2, "optimizer": o2}).wait_durable(timeout=60)
        third = index_of(daemon, "guard", 3)
        assert third.quantization == {"generation": 1, "quantize": None, "master_weights": "keep"}
        assert all(f.quant is None for t in third.tensors for f in t.fragments)
        ckpt.save(4, {"model": m2, "optimizer": o2}, quantize="O1").wait_durable(timeout=60)
        assert index_of(daemon, "guard", 4).quantization["quantize"] is None  # the guard wins over the request too
    daemon.stop()
    # configured otherwise: two lossy generations allowed
    daemon = daemons.start("--quantize", "O2", "--quant-max-generations", "2", "--keep-last", "0")
    with CheckpointClient("guard", address=daemon.address, on_error="raise") as ckpt:
        m3, o3 = fresh()
        ckpt.load({"model": m3, "optimizer": o3}, step=1)
        ckpt.save(5, {"model": m3, "optimizer": o3}).wait_durable(timeout=60)
        assert index_of(daemon, "guard", 5).quantization == {"generation": 2, "quantize": "O2", "master_weights": "keep"}


def test_bad_options_are_refused_with_a_clear_message(daemon) -> None:
    model, opt = trained(steps=1)
    with CheckpointClient("bad", address=daemon.address, on_error="raise") as ckpt:
        with pytest.raises(ValueError, match="'none' \\(lossless\\) or None"):
            ckpt.save(1, {"model": model, "optimizer": opt}, quantize="int4")
        with pytest.raises(ValueError, match="keep"):
            ckpt.save(1, {"model": model, "optimizer": opt}, master_weights="fp16")


def test_inspect_shows_the_quantization(daemon) -> None:
    model, opt = trained()
    with CheckpointClient("insp", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt}, quantize="O1").wait_durable(timeout=60)
    step_dir = daemon.root / "insp" / "step-00000005"
    run = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", str(step_dir), "--json"], capture_output=True, text=True, check=True)
    doc = json.loads(run.stdout)
    assert doc["quantization"]["quantize"] == "O1" and doc["quantization"]["generation"] == 1
    tensor = doc["tensors"]["optimizer/state/up.weight/exp_avg"]
    assert tensor["fragments"][0]["quant"]["codec"] == "lin-i8" and tensor["fragments"][0]["quant"]["block"] == 256
    assert tensor["fragments"][0]["quant"]["scales"]["key"].endswith("@scales")
    assert "frames" not in tensor["fragments"][0]["quant"]  # int8 codes are stored as they are
    text = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", str(step_dir)], capture_output=True, text=True, check=True).stdout
    assert "lin-i8" in text and "generation 1" in text and "optimizer/state/up.weight/exp_avg_sq" in text
    with CheckpointClient("insp", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(6, {"model": model, "optimizer": opt}, quantize="O2").wait_durable(timeout=60)
    text = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", str(daemon.root / "insp" / "step-00000006")], capture_output=True, text=True, check=True).stdout
    rows_per_frame = frames.FRAME_BYTES // (96 // 2)  # up.weight is (300, 96): 48 bytes of int4 codes per row
    assert "lin-i4 block 128" in text and f"in 1 zstd frames of {rows_per_frame} rows" in text


def test_a_tensor_with_non_finite_values_is_stored_losslessly(daemon) -> None:
    model, opt = trained()
    state = opt_state(model, opt)
    state["up.weight"]["exp_avg"][3, 4] = float("nan")
    state["down.weight"]["exp_avg_sq"][0, 0] = float("inf")
    with CheckpointClient("nonfinite", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt}, quantize="O2").wait_durable(timeout=60)
        m2, o2 = fresh()
        ckpt.load({"model": m2, "optimizer": o2})
    index = index_of(daemon, "nonfinite", 5).by_name()
    assert index["optimizer/state/up.weight/exp_avg"].fragments[0].quant is None
    assert index["optimizer/state/down.weight/exp_avg_sq"].fragments[0].quant is None
    assert index["optimizer/state/up.weight/exp_avg_sq"].fragments[0].quant is not None
    loaded = opt_state(m2, o2)
    nan = torch.isnan(state["up.weight"]["exp_avg"])
    assert torch.equal(torch.isnan(loaded["up.weight"]["exp_avg"]), nan)
    assert torch.equal(loaded["up.weight"]["exp_avg"][~nan], state["up.weight"]["exp_avg"][~nan])
    assert torch.equal(loaded["down.weight"]["exp_avg_sq"], state["down.weight"]["exp_avg_sq"])


def test_small_files_with_codes_and_a_lossless_fallback_stay_valid(daemons) -> None:
    """Files of at most 20 kB: coded tensors (with their scales) and a tensor that falls back to
    lossless (a nan) land in different files; each file's header, written after its codes, is
    read by the safetensors library, `ckptd verify` passes and the load gives the values back."""
    daemon = daemons.start("--max-file-bytes", "20000")
    model, opt = trained()
    opt_state(model, opt)["down.weight"]["exp_avg"][1, 2] = float("nan")
    with CheckpointClient("split", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt}, quantize="O2").wait_durable(timeout=60)
        m2, o2 = fresh()
        ckpt.load({"model": m2, "optimizer": o2})
    step_dir = daemon.root / "split" / "step-00000005"
    index = index_of(daemon, "split", 5)
    files = sorted(f.name for f in index.files if f.name.startswith("optimizer-"))
    assert len(files) >= 3
    for name in files:
        with safe_open(str(step_dir / name), "pt") as f:
            for key in f.keys():
                f.get_tensor(key)
        assert (step_dir / name).stat().st_size == next(r.size for r in index.files if r.name == name)
    up = index.by_name()["optimizer/state/up.weight/exp_avg"].fragments[0]
    assert up.quant is not None and up.quant.frames is not None
    assert index.by_name()["optimizer/state/down.weight/exp_avg"].fragments[0].quant is None
    verify = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "verify", str(step_dir)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    loaded, saved = opt_state(m2, o2), opt_state(model, opt)
    assert torch.equal(loaded["up.bias"]["exp_avg"], saved["up.bias"]["exp_avg"])
    nan = torch.isnan(saved["down.weight"]["exp_avg"])
    assert torch.equal(loaded["down.weight"]["exp_avg"][~nan], saved["down.weight"]["exp_avg"][~nan])
    assert float((loaded["up.weight"]["exp_avg"] - saved["up.weight"]["exp_avg"]).abs().max()) > 0


def test_a_client_that_cannot_decode_is_refused(daemon) -> None:
    """An older client (no PlanLoadRequest.decodes) would take codes for values: refused."""
    import grpc

    from ckptd.wire.v1 import checkpoint_pb2 as pb
    from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

    model, opt = trained()
    with CheckpointClient("old", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt}, quantize="O2").wait_durable(timeout=60)
    meta = pb.TensorMeta(name="optimizer/state/up.weight/exp_avg", kind="optimizer", dtype="F32", shape=[300, 96],
                         box=pb.Box(offsets=[0, 0], lengths=[300, 96]))
    request = pb.PlanLoadRequest(who=pb.RankId(job="old", rank=0, world_size=1), latest=True, tensors=[meta], kinds=["optimizer"])
    with grpc.insecure_channel(daemon.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CheckpointStub(channel).PlanLoad(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cannot decode" in info.value.details()
        request.decodes = True  # a client of the first compressed format: codes stored as they are, no frames
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CheckpointStub(channel).PlanLoad(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "zstd frames" in info.value.details()


def test_inspect_a_lossless_step_and_a_wrong_directory(daemon, tmp_path: Path) -> None:
    model, opt = trained(steps=1)
    with CheckpointClient("plain", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
    step_dir = daemon.root / "plain" / "step-00000001"
    run = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", str(step_dir)], capture_output=True, text=True, check=True)
    assert "quantization: none (lossless, generation 0)" in run.stdout and "model/up.weight" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a committed step directory" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nowhere does not exist" in missing.stderr  # not "has no ckptd.index.json"


@pytest.mark.parametrize("mode", ["O2", "residual"])
def test_a_trainer_that_cannot_read_the_root_gets_compressed_steps_staged(module_daemons, daemon, mode: str) -> None:
    """read_files=False: the daemon copies codes, scales and residual bases into shared memory;
    the client decodes from there exactly as from the files."""
    if mode == "O2":
        model, opt = trained()
        state, kwargs = {"model": model, "optimizer": opt}, {"quantize": "O2"}
    else:
        model, master, _ = mixed_precision()
        state, kwargs = {"model": model, "master": master}, {"master_weights": "residual"}
    job = f"staged-{mode}"
    with CheckpointClient(job, address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, state, **kwargs).wait_durable(timeout=60)
    loaded = []
    for read_files in (True, False):
        fresh_state = dict(zip(("model", "optimizer"), fresh())) if mode == "O2" else dict(zip(("model", "master"), mixed_precision(seed=5)[:2]))
        with CheckpointClient(job, address=daemon.address, on_error="raise", read_files=read_files) as ckpt:
            recorded = _RecordedPlanLoad(ckpt._rpc.stub.PlanLoad)
            ckpt._rpc.stub.PlanLoad = recorded
            ckpt.load(fresh_state)
            plans = recorded.answers
        coded = [p for plan in plans for p in plan.pieces if p.decode.codec]
        assert coded and all(p.decode.scales.path or p.decode.base.path for p in coded)
        for piece in coded:
            for where in (piece, piece.decode.scales if piece.decode.scales.path else piece.decode.base):
                # staged: a copy of the file's bytes in shared memory, read like the file
                assert Path(where.path).is_relative_to(daemon.root if read_files else module_daemons.shm_dir), where.path
        if mode == "O2":
            loaded.append(opt_state(fresh_state["model"], fresh_state["optimizer"])["up.weight"]["exp_avg_sq"].clone())
        else:
            loaded.append(fresh_state["master"]["up.weight"].clone())
    assert torch.equal(loaded[0], loaded[1])


class _RecordedPlanLoad:
    """The stub's PlanLoad, called or sent ahead (a future), recording every answer taken."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.answers: list[Any] = []

    def __call__(self, request: Any, **kw: Any) -> Any:
        answer = self.plan(request, **kw)
        self.answers.append(answer)
        return answer

    def future(self, request: Any, **kw: Any) -> Any:
        return _RecordedCall(self.plan.future(request, **kw), self.answers)


class _RecordedCall:
    """A PlanLoad future whose answer is recorded when taken."""

    def __init__(self, call: Any, answers: list[Any]) -> None:
        self._call, self._answers = call, answers

    def result(self, *args: Any, **kw: Any) -> Any:
        answer = self._call.result(*args, **kw)
        self._answers.append(answer)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)
