"""One rank of a gloo job that saves or loads DTensors through ckptd: `python dist_worker.py SPEC_JSON`.

The spec (JSON): address, job, step, mode ("save" | "load"), mesh (list of sizes), placements
({tensor name: [placement per mesh dim]}, a placement being ["S", dim] or ["R"]), world_size,
port, rank, out (a directory: rank r writes r.json with what it found). The global values are a
pure function of the tensor name, so every layout can check what it loaded. Several nodes:
`addresses` (each rank's daemon) and `local_world_size` (per rank: the ranks on its node)
replace `address`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from gloo_rank import run_rank  # beside this script

SHAPES = {"w_even": (8, 6), "w_uneven": (13, 7), "b": (5,), "tiny": (2, 3)}
MOMENT_SHAPES = {"exp_avg": (40, 300), "exp_avg_sq": (40, 300)}  # with spec["optimizer"]


def global_value(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    value = torch.randn({**SHAPES, **MOMENT_SHAPES}[name], generator=g)
    return value.square() if name == "exp_avg_sq" else value


def placements_of(spec: list[list]) -> list:
    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in spec]


def run(spec: dict) -> None:
    from ckptd.client import CheckpointClient

    mesh = init_device_mesh("cpu", tuple(spec["mesh"]))
    model = {}
    for name, placement in spec["placements"].items():
        value = global_value(name) if spec["mode"] == "save" else torch.zeros({**SHAPES, **MOMENT_SHAPES}[name])
        model[name] = distribute_tensor(value, mesh, placements_of(placement))
    result: dict = {"rank": spec["rank"]}
    address = spec["addresses"][spec["rank"]] if "addresses" in spec else spec["address"]
    local = spec.get("local_world_size")  # several nodes: ranks on this rank's node
    local_world_size = local[spec["rank"]] if isinstance(local, list) else local
    with CheckpointClient(spec["job"], address=address, on_error="raise", timeout_s=60, local_world_size=local_world_size) as ckpt:
        # "optimizer": the tensors are Adam moments ({"optimizer": {"state": {"w": {name: ...}}}}), quantized
        # with spec["quantize"]; a load writes the whole tensors it got to out/<rank>.safetensors
        state = {"optimizer": {"state": {"w": model}}} if spec.get("optimizer") else {"model": model}
        if spec["mode"] == "save":
            handle = ckpt.save(spec["step"], state, quantize=spec.get("quantize"))
            result["bytes_copied"] = handle.bytes_copied
            handle.wait_durable(timeout=60)
        else:
            result["step"] = ckpt.load(state, step=spec["step"])
            result["exact"] = {name: bool(torch.equal(t.full_tensor(), global_value(name))) for name, t in model.items()}
            if spec.get("optimizer"):
                from safetensors.torch import save_file

                save_file({name: t.full_tensor() for name, t in model.items()}, str(Path(spec["out"], f"{spec['rank']}.safetensors")))
    Path(spec["out"], f"{spec['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_rank(run)
