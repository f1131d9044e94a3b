"""FP8 and other low-precision tensors (issue 31 item 4): float8_e4m3fn / float8_e5m2 weights
with their scales, in model, master and optimizer state, saved by two ranks with quantization
on, restored by one and by three ranks byte for byte and never quantized; read back by the
offline reader, `ckptd export` (safetensors F8_E4M3 / F8_E5M2) and `export_dcp`; tensor
subclasses (torchao's float8 training tensors) stored exactly or refused with the reason."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from ckptd.client import CheckpointClient, LocalShard
from ckptd.daemon.tools.export import export_model
from ckptd.integrations.dcp import export_dcp
from ckptd.offline import open_step

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ROWS, COLS = 96, 64  # above LOSSLESS_MAX_ELEMENTS: an fp32 moment of this shape is quantized under O1


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, COLS, generator=g)
    return {
        "model/w_fp8": (x * 3).to(E4),
        "model/w_scale": torch.rand(ROWS, 1, generator=g),
        "model/head_fp8": torch.randn(ROWS, COLS, generator=g).to(E5),
        "master/w_fp8": x.clone(),  # fp32 master of an fp8 weight: no residual (only bf16/fp16 models have one)
        "optimizer/state/w_fp8/exp_avg": (x / 7).to(E5),
        "optimizer/state/w_fp8/exp_avg_sq": (x * x).to(E4),
        "optimizer/state/w_fp8/exp_avg_scale": torch.rand(ROWS, 1, generator=g),
        "optimizer/state/dense/exp_avg": torch.randn(ROWS, COLS, generator=g),  # quantized: the options are on
    }


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype in (E4, E5) else t


def nest(flat: dict[str, object]) -> dict[str, dict]:
    state: dict[str, dict] = {}
    for name, value in flat.items():
        key, _, path = name.partition("/")
        if key == "optimizer":
            _, fqn, field = path.split("/")
            state.setdefault(key, {}).setdefault("state", {}).setdefault(fqn, {})[field] = value
        else:
            state.setdefault(key, {})[path] = value
    return state


def shards(full: dict[str, torch.Tensor], world: int, rank: int, fill: bool) -> dict[str, LocalShard]:
    """Row shards of every tensor for `rank` of `world` (zeros to load into when not `fill`)."""
    out = {}
    for name, t in full.items():
        lo, hi = ROWS * rank // world, ROWS * (rank + 1) // world
        part = t[lo:hi].clone() if fill else torch.zeros(hi - lo, *t.shape[1:]).to(t.dtype)
        out[name] = LocalShard(part, (lo, *[0] * (t.ndim - 1)), tuple(t.shape))
    return out


def as_ranks(world: int, job: str, address: str, action):
    def one(rank: int):
        with CheckpointClient(job, address=address, rank=rank, world_size=world, local_world_size=world, on_error="raise") as ckpt:
            return action(rank, ckpt)

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


# issue 31 item 4
def test_fp8_weights_scales_and_moments_reshard_exactly_with_quantization_on(daemon, tmp_path: Path) -> None:
    full = full_state()

    def save(rank: int, ckpt: CheckpointClient):
        state = nest(shards(full, 2, rank, fill=True))
        return ckpt.save(1, state, quantize="O1", master_weights="residual").wait_durable(timeout=60)

    info = as_ranks(2, "fp8", daemon.address, save)[0]
    step = open_step(info.step_dir)
    records = {t.name: t for t in step.index.tensors}
    for name, t in full.items():
        record = records[name]
        if t.dtype in (E4, E5):
            assert record.dtype == {E4: "F8_E4M3", E5: "F8_E5M2"}[t.dtype] and not record.lossy, name
    assert records["optimizer/state/dense/exp_avg"].lossy  # the options were on, and left fp8 alone
    assert not records["master/w_fp8"].lossy

    for world in (1, 3):
        def load(rank: int, ckpt: CheckpointClient, world: int = world):
            targets = shards(full, world, rank, fill=False)
            assert ckpt.load(nest(targets)) == 1
            return targets

        for rank, targets in enumerate(as_ranks(world, "fp8", daemon.address, load)):
            for name, shard in targets.items():
                if name == "optimizer/state/dense/exp_avg":
                    continue  # int8 codes: close, not exact (test_quantize.py)
                lo = shard.offsets[0]
                want = full[name][lo : lo + shard.tensor.shape[0]]
                assert torch.equal(raw(shard.tensor), raw(want)), (world, rank, name)

    # the offline reader, `ckptd export` and export_dcp carry the fp8 bytes and dtypes as they are
    got = step.tensors_named(["model/w_fp8", "model/head_fp8", "optimizer/state/w_fp8/exp_avg"])
    for name, t in got.items():
        assert t.dtype == full[name].dtype and torch.equal(raw(t), raw(full[name])), name
    files = export_model(Path(info.step_dir), tmp_path / "hf")
    exported = {}
    for path in [f for f in files if f.suffix == ".safetensors"]:
        with safe_open(str(path), "pt") as f:
            exported.update({k: f.get_tensor(k) for k in f.keys()})
        header_len = int.from_bytes(path.read_bytes()[:8], "little")
        dtypes = {k: v["dtype"] for k, v in json.loads(path.read_bytes()[8 : 8 + header_len]).items() if k != "__metadata__"}
        assert dtypes.get("w_fp8", "F8_E4M3") == "F8_E4M3" and dtypes.get("head_fp8", "F8_E5M2") == "F8_E5M2"
    assert torch.equal(raw(exported["w_fp8"]), raw(full["model/w_fp8"])) and torch.equal(exported["w_scale"], full["model/w_scale"])
    assert torch.equal(raw(exported["head_fp8"]), raw(full["model/head_fp8"]))
    export_dcp(info.step_dir, tmp_path / "dcp")
    back = {"model.w_fp8": torch.zeros(ROWS, COLS).to(E4), "optimizer.state.w_fp8.exp_avg": torch.zeros(ROWS, COLS).to(E5)}
    dcp.load(back, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(raw(back["model.w_fp8"]), raw(full["model/w_fp8"]))
    assert torch.equal(raw(back["optimizer.state.w_fp8.exp_avg"]), raw(full["optimizer/state/w_fp8/exp_avg"]))


# issue 31 item 4: tensor subclasses
def test_torchao_float8_weight_wrappers_round_trip_and_float8_training_tensors_are_refused(daemon) -> None:
    pytest.importorskip("torchao.float8.fsdp_utils", reason="torchao (the test extra, torchao==0.18.0) is not installed")
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)
    value = model.weight.detach().clone()
    # what torchao's convert_to_float8_training(enable_fsdp_float8_all_gather=True) makes of a weight
    model.weight = torch.nn.Parameter(WeightWithDynamicFloat8CastTensor(model.weight.detach().clone(), LinearMMConfig(), E4))
    with CheckpointClient("ao", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(1, {"model": model}).wait_durable(timeout=60)
        assert torch.equal(open_step(info.step_dir).tensors_named(["model/weight"])["model/weight"], value)
        with torch.no_grad():
            model.weight._tensor.zero_()
        assert ckpt.load({"model": model}) == 1
        assert type(model.weight.data) is WeightWithDynamicFloat8CastTensor and torch.equal(model.weight._tensor, value)

        f8 = Float8TrainingTensor(value.to(E4), torch.tensor(2.0), torch.float32, LinearMMConfig(), GemmInputRole.WEIGHT)
        with pytest.raises(TypeError, match=r"Float8TrainingTensor .*_data: torch.float8_e4m3fn\[4, 8\], _scale.*save its parts"):
            ckpt.save(2, {"model": {"w": f8}})
        # its parts are plain tensors, stored exactly
        info = ckpt.save(2, {"model": {"w": f8._data, "w_scale": f8._scale}}).wait_durable(timeout=60)
        got = open_step(info.step_dir).tensors_named(["model/w", "model/w_scale"])
        assert torch.equal(raw(got["model/w"]), raw(f8._data)) and torch.equal(got["model/w_scale"], f8._scale)
