"""One rank of a gloo job that saves, or loads and checks, the parallel layouts of
test_parallel_layouts.py: `python layouts_rank.py SPEC_JSON`.

Spec: mode "save" | "load", address (the daemon), out (a directory), and the world size it runs
at. Every scenario runs in one process group, each under its own job:

- "dt" / "dt-dcp": a MoE model as DTensors on a 2-D mesh (dp, tp): dense weights tensor
  parallel and replicated over dp; the stacked experts Shard(0) over dp (expert parallel) and
  Shard(1) over tp; an FP8 (float8_e4m3fn) expert weight with its per-expert scales, and FP8
  (float8_e5m2) optimizer state; saved with the plain client / with dcp.save through
  CkptdStorageWriter. The mesh is (2, 2) at 4 ranks, (2, 1) at 2, (1, 1) at 1.
- "ep", "pp", "ppep": Megatron-style modules (ckptd.client.layout rules) trained one Adam step:
  experts under local indices (`Expert`), pipeline stages keeping global names with the output
  layer of the last stage tied to the embedding of the first (`StoredAs`); "ep" is EP = world,
  "pp" is PP = world, "ppep" is PP 2 x EP 2 at 4 ranks, PP 2 x EP 1 at 2, 1 x 1 at 1.
- "pp-dcp": pipeline stages as plain dicts with global names through DCP, the last stage's
  copy of the embedding under the embedding's key, and experts (EP = world) under their global
  index, as Megatron's sharded_state_dict names them.

A saving rank writes the values it saved, by stored name, to out/expected-<job>-<rank>.safetensors
(FP8 as raw bytes); a loading rank compares what it loaded with them, byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_rank import run_rank  # noqa: E402

H, F, V, E, LAYERS = 8, 12, 16, 4, 4
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def values(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that is a pure function of its name (every process makes the same)."""
    g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(name)))
    t = torch.randn(shape, generator=g)
    return t.to(dtype) if dtype in FP8 else t


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, for exact comparison (torch.equal has no FP8 kernels on the CPU)."""
    return t.detach().contiguous().view(torch.uint8) if t.dtype in FP8 else t.detach().contiguous()


# ------------------------------------------------------------------ DTensor MoE (TP x DP x EP)

DT_SHAPES = {
    "model.embed.weight": ((V, H), torch.float32, "dense"),
    "model.layers.0.attn.weight": ((H, H), torch.float32, "dense"),
    "model.layers.0.moe.w1": ((E, F, H), torch.float32, "experts"),
    "model.layers.0.moe.w1_fp8": ((E, F, H), torch.float8_e4m3fn, "experts"),
    "model.layers.0.moe.w1_scale": ((E,), torch.float32, "experts"),
    "optimizer.state.layers.0.moe.w1.exp_avg": ((E, F, H), torch.float32, "experts"),
    "optimizer.state.layers.0.moe.w1.exp_avg_fp8": ((E, F, H), torch.float8_e5m2, "experts"),
    "optimizer.state.layers.0.moe.w1.exp_avg_scale": ((E,), torch.float32, "experts"),
}


def dt_mesh(world: int):
    return init_device_mesh("cpu", (min(world, 2), world // min(world, 2)), mesh_dim_names=("dp", "tp"))


def dt_state(mesh, fill: bool) -> dict[str, dict]:
    """{"model": {...}, "optimizer": {...}} of DTensors built from their local shards (gloo moves no FP8)."""
    state: dict[str, dict] = {"model": {}, "optimizer": {}}
    for fqn, (shape, dtype, kind) in DT_SHAPES.items():
        placements = [Replicate(), Shard(0)] if kind == "dense" else [Shard(0), Shard(1) if len(shape) > 1 else Replicate()]
        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        full = values(fqn, shape, dtype)
        local = full[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))].clone() if fill else torch.zeros(local_shape).to(dtype)
        key, _, path = fqn.partition(".")
        state[key][path] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=full.stride())
    return state


def dt_check(state: dict[str, dict], job: str) -> None:
    for fqn, (shape, dtype, _) in DT_SHAPES.items():
        key, _, path = fqn.partition(".")
        t = state[key][path]
        assert isinstance(t, DTensor) and t.dtype == dtype, (job, fqn, type(t), t.dtype)
        local_shape, offsets = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
        want = values(fqn, shape, dtype)[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))]
        assert torch.equal(raw(t.to_local()), raw(want)), f"{job}: {fqn} differs on rank {dist.get_rank()}"


# ------------------------------------------------------------------ Megatron-style modules (PP x EP)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(F, H))
        self.register_buffer("w1_fp8", torch.zeros(F, H).to(torch.float8_e4m3fn))
        self.register_buffer("w1_scale", torch.zeros(1))


class Layer(nn.Module):
    def __init__(self, local_experts: int) -> None:
        super().__init__()
        self.attn = nn.Linear(H, H, bias=False)
        self.moe = nn.Module()
        self.moe.experts = nn.ModuleList([Expert() for _ in range(local_experts)])


class Stage(nn.Module):
    """The layers [first, last) of the model keeping their global names; the embedding on the
    first stage, the output layer on the last, one tied tensor when both are here."""

    def __init__(self, pp_rank: int, pp_size: int, ep_size: int) -> None:
        super().__init__()
        per = LAYERS // pp_size
        self.layers = nn.ModuleDict({str(i): Layer(E // ep_size) for i in range(pp_rank * per, (pp_rank + 1) * per)})
        if pp_rank == 0:
            self.embed = nn.Embedding(V, H)
        if pp_rank == pp_size - 1:
            self.lm_head = nn.Linear(H, V, bias=False)
            if pp_rank == 0:
                self.lm_head.weight = self.embed.weight


def megatron_rules():
    from ckptd.client.layout import Expert as ExpertRule, LayoutRules, Rule, StoredAs

    return LayoutRules([
        Rule(r"layers\.\d+\.moe\.experts\.(\d+)\..*", ExpertRule(num_experts=E)),
        Rule(r"lm_head\.weight", StoredAs("embed.weight")),
    ])


def global_name(local: str, ep_rank: int, ep_size: int) -> str:
    """The stored name of a parameter FQN (what the rules do): global expert index, lm_head as embed."""
    parts = local.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        parts[i] = str(ep_rank * (E // ep_size) + int(parts[i]))
    name = ".".join(parts)
    return "embed.weight" if name == "lm_head.weight" else name


def megatron_coords(job: str, rank: int, world: int) -> tuple[int, int, int, int]:
    """(pp_rank, pp_size, ep_rank, ep_size) of `rank` in scenario `job` at `world` ranks."""
    if job == "ep":
        return 0, 1, rank, world
    if job == "pp":
        return rank, world, 0, 1
    pp = min(world, 2)
    return rank // (world // pp), pp, rank % (world // pp), world // pp


def megatron_save(job: str, spec: dict) -> None:
    from ckptd.client import CheckpointClient
    from ckptd.client.layout import RankCoords

    rank, world = dist.get_rank(), dist.get_world_size()
    pp_rank, pp_size, ep_rank, ep_size = megatron_coords(job, rank, world)
    stage = Stage(pp_rank, pp_size, ep_size)
    named = dict(stage.named_parameters(remove_duplicate=False)) | dict(stage.named_buffers())
    with torch.no_grad():
        for local, t in named.items():
            t.copy_(values(global_name(local, ep_rank, ep_size), tuple(t.shape), t.dtype))
    opt = torch.optim.Adam(stage.parameters(), lr=0.01)
    for local, p in stage.named_parameters():
        p.grad = values("grad." + global_name(local, ep_rank, ep_size), tuple(p.shape))
    opt.step()
    expected = {}
    for local, t in named.items():
        expected[f"model/{global_name(local, ep_rank, ep_size)}"] = raw(t)
    for local, p in stage.named_parameters():
        for field, s in opt.state[p].items():
            expected[f"optimizer/state/{global_name(local, ep_rank, ep_size)}/{field}"] = s.detach().clone()
    save_file(expected, f"{spec['out']}/expected-{job}-{rank}.safetensors")
    coords = RankCoords(0, 1, ep_rank=ep_rank, ep_size=ep_size)
    with CheckpointClient(job, address=spec["address"], on_error="raise", layout=megatron_rules(), coords=coords) as ckpt:
        ckpt.save(1, {"model": stage, "optimizer": opt}).wait_durable(timeout=120)


def megatron_load(job: str, spec: dict, expected: dict[str, torch.Tensor]) -> None:
    from ckptd.client import CheckpointClient
    from ckptd.client.layout import RankCoords

    rank, world = dist.get_rank(), dist.get_world_size()
    pp_rank, pp_size, ep_rank, ep_size = megatron_coords(job, rank, world)
    stage = Stage(pp_rank, pp_size, ep_size)
    opt = torch.optim.Adam(stage.parameters(), lr=0.01)
    coords = RankCoords(0, 1, ep_rank=ep_rank, ep_size=ep_size)
    with CheckpointClient(job, address=spec["address"], on_error="raise", layout=megatron_rules(), coords=coords) as ckpt:
        assert ckpt.load({"model": stage, "optimizer": opt}, strict="missing") == 1
    named = dict(stage.named_parameters(remove_duplicate=False)) | dict(stage.named_buffers())
    for local, t in named.items():
        name = f"model/{global_name(local, ep_rank, ep_size)}"
        assert torch.equal(raw(t), expected[name]), f"{job}: {local} (stored as {name}) differs on rank {rank}"
    for local, p in stage.named_parameters():
        assert opt.state[p], f"{job}: no optimizer state for {local} on rank {rank}"
        for field, s in opt.state[p].items():
            name = f"optimizer/state/{global_name(local, ep_rank, ep_size)}/{field}"
            assert torch.equal(s, expected[name]), f"{job}: {name} differs on rank {rank}"
    # the optimizer trains on from the loaded state exactly as the saved one would have
    assert all(int(opt.state[p]["step"]) == 1 for p in stage.parameters())


# ------------------------------------------------------------------ pipeline stages through DCP


def pp_dcp_state(fill: bool) -> dict[str, dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = LAYERS // world
    names = [f"layers.{i}.attn.weight" for i in range(rank * per, (rank + 1) * per)]
    if rank in (0, world - 1):  # the last stage's output layer is stored as the embedding it is tied to
        names.append("embed.weight")
    per = E // world  # and expert parallel over the same ranks: each rank's experts under their global index
    names += [f"moe.experts.{e}.w1" for e in range(rank * per, (rank + 1) * per)]
    shapes = {n: (V, H) if n == "embed.weight" else (F, H) if ".experts." in n else (H, H) for n in names}
    return {"model": {n: values(n, s) if fill else torch.zeros(s) for n, s in shapes.items()}}


# ------------------------------------------------------------------ the rank


def body(spec: dict) -> None:
    from ckptd.integrations.dcp import CkptdStorageReader, CkptdStorageWriter
    from ckptd.client import CheckpointClient

    world = dist.get_world_size()
    mesh = dt_mesh(world)
    if spec["mode"] == "save":
        with CheckpointClient("dt", address=spec["address"], on_error="raise") as ckpt:
            ckpt.save(1, dt_state(mesh, fill=True)).wait_durable(timeout=120)
        for job, state in (("dt-dcp", dt_state(mesh, fill=True)), ("pp-dcp", pp_dcp_state(fill=True))):
            writer = CkptdStorageWriter(job, address=spec["address"], durable=True)
            dcp.save(state, storage_writer=writer, checkpoint_id=1)
            writer.close()
        for job in ("ep", "pp", "ppep"):
            megatron_save(job, spec)
        return
    root = Path(spec["root"])
    state = dt_state(mesh, fill=False)
    with CheckpointClient("dt", address=spec["address"], on_error="raise") as ckpt:
        assert ckpt.load(state) == 1
    dt_check(state, "dt")
    state = dt_state(mesh, fill=False)
    dcp.load(state, storage_reader=CkptdStorageReader(root / "dt-dcp" / "step-00000001"))
    dt_check(state, "dt-dcp")
    state = pp_dcp_state(fill=False)
    dcp.load(state, storage_reader=CkptdStorageReader(root / "pp-dcp" / "step-00000001"))
    for name, t in state["model"].items():
        assert torch.equal(t, values(name, tuple(t.shape))), f"pp-dcp: {name} differs on rank {dist.get_rank()}"
    for job in ("ep", "pp", "ppep"):
        expected: dict[str, torch.Tensor] = {}
        for path in sorted(Path(spec["out"]).glob(f"expected-{job}-*.safetensors")):
            expected.update(load_file(str(path)))
        megatron_load(job, spec, expected)


if __name__ == "__main__":
    run_rank(body)
