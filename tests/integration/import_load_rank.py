"""One rank of a gloo job that loads an imported step through ckptd into a model whose
parameters are DTensors sharded with Shard(0), and compares them with the source's whole
tensors: `python import_load_rank.py SPEC_JSON`.

The model: a Hugging Face model built from the config in spec["hf_config"] (a directory), or
else a tree of modules with one parameter per "model/<fqn>" name of the reference. With
spec["optimizer"], an AdamW over it is loaded too and its state compared. Spec: address, job,
step, reference (a safetensors file of whole tensors under ckptd names), rank, world_size,
port, out (a directory: rank r writes r.json: step, exact {name: bool}, lr).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from gloo_rank import run_rank  # beside this script


def module_tree(shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> nn.Module:
    """Modules nested as the dotted names say, each name a parameter of zeros."""
    root = nn.Module()
    for fqn, (shape, dtype) in shapes.items():
        node = root
        *path, attr = fqn.split(".")
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.register_parameter(attr, nn.Parameter(torch.zeros(shape, dtype=dtype)))
    return root


def shard_parameters(model: nn.Module, mesh) -> None:
    """Every parameter becomes a DTensor of zeros, Shard(0) (a 0-d one replicated)."""
    for name, param in list(model.named_parameters()):
        owner, _, attr = name.rpartition(".")
        placement = [Shard(0)] if param.dim() else [Replicate()]
        zeros = distribute_tensor(torch.zeros_like(param.detach()), mesh, placement)
        setattr(model.get_submodule(owner), attr, nn.Parameter(zeros, requires_grad=param.requires_grad))


def whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def run(spec: dict) -> None:
    from ckptd.client import CheckpointClient

    mesh = init_device_mesh("cpu", (spec["world_size"],))
    reference = load_file(spec["reference"])
    if "hf_config" in spec:
        import transformers

        config = transformers.AutoConfig.from_pretrained(spec["hf_config"])
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = module_tree({n[len("model/"):]: (t.shape, t.dtype) for n, t in reference.items() if n.startswith("model/")})
    shard_parameters(model, mesh)
    state: dict = {"model": model}
    if spec.get("optimizer"):
        state["optimizer"] = torch.optim.AdamW(model.parameters(), lr=0.5)
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60) as ckpt:
        step = ckpt.load(state, step=spec["step"])
    exact = {f"model/{fqn}": torch.equal(whole(p.detach()), reference[f"model/{fqn}"]) for fqn, p in model.named_parameters()}
    result: dict = {"step": step, "exact": exact, "placements": sorted({str(p.placements) for p in model.parameters()})}
    if "optimizer" in state:
        opt = state["optimizer"]
        for fqn, param in model.named_parameters():
            for field, value in opt.state[param].items():
                exact[f"optimizer/state/{fqn}/{field}"] = torch.equal(whole(value), reference[f"optimizer/state/{fqn}/{field}"])
        result["lr"] = opt.param_groups[0]["lr"]
    Path(spec["out"], f"{spec['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_rank(run)
