"""One rank of the training runs of test_train_layouts.py: `python train_layouts_rank.py SPEC_JSON`.

A tiny model trained with AdamW in one parallel layout, saved through the plain ckptd client
after every step and resumed from the daemon's newest committed step at start. The strategies
(spec["strategy"]; every rank of a world of `world_size` holds the part its layout gives it):

- "fsdp2": `fully_shard` over a 1-D mesh of all ranks (data parallel, parameters Shard(0));
- "hsdp": `fully_shard` over a 2-D mesh (replicate 2, shard world/2): `[Replicate, Shard(0)]`;
- "tp": `parallelize_module` colwise/rowwise over all ranks (every rank sees the same batch);
- "pp": stage modules keeping their global names (`layers.<i>.*`), the embedding on the first
  stage tied to the output layer on the last (`StoredAs("embed.weight")`; one tensor at PP=1),
  run by torch.distributed.pipelining's `PipelineStage` and `ScheduleGPipe`, the tied gradients
  summed;
- "ep": a MoE block whose experts are split over the ranks under local indices (`Expert`),
  tokens gathered to every rank, each expert's output summed back; dense parts data parallel;
- "ep-dtensor": the same block with stacked experts, DTensors with `Shard(0)` on the expert
  dimension.

Every parameter starts as a pure function of its stored name, so every layout starts from the
same model; the data of a step is a pure function of the step. The loss logged is the global
batch's (the same on every rank).

Spec (JSON): strategy, address, job, steps, out (a directory), mode, plus rank, world_size, port.
- mode "train": load the newest step (if any), train to `steps`, saving each. Rank 0 appends
  {"step", "loss", "resumed_from"} per trained step to out/losses.jsonl. `kill: {"rank", "step"}`:
  that rank waits until `step` is durable, and SIGKILLs itself right after its save of step+1
  returns (the bytes copied, the commit that hands them over still in flight). At the end every rank writes
  what it holds, by stored name, to out/saved-<rank>.safetensors; with `reference`, it then
  trains a fresh model without ckptd: what it holds after `steps` steps to
  out/reference-<rank>.safetensors, and rank 0 writes the losses of steps+1 steps to
  out/reference.json.
- mode "check": load step `steps` into this layout (world size), write what it holds to
  out/loaded-<rank>.safetensors, train one more step and (rank 0) write its loss to
  out/next_loss.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_rank import run_rank  # noqa: E402

IN, H, F, V, E, LAYERS, BATCH, SEQ = 8, 16, 24, 16, 4, 4, 8, 6


def values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A parameter's initial value: a pure function of its stored name."""
    g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(name)))
    return torch.randn(shape, generator=g) * 0.3


def init_by_name(module: nn.Module, stored: Callable[[str], str]) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(values(stored(name), tuple(p.shape)))


def regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This data-parallel rank's share of a global batch."""
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (the global batch's loss when each rank has an equal share)."""
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


class AllReduceSum(torch.autograd.Function):
    """Sum over all ranks; its gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        dist.all_reduce(out)
        return out


class Strategy:
    """A model in one layout: what is saved, how it loads, a training step, and what it holds."""

    strict: bool | str = True

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.model: nn.Module = self.build()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.02, weight_decay=0.01, foreach=False)

    def build(self) -> nn.Module:
        raise NotImplementedError

    def client_options(self) -> dict[str, Any]:
        return {}

    def stored(self, name: str) -> str:
        """The stored name of a parameter of this rank's module."""
        return name

    def train_step(self, step: int) -> float:
        """One optimizer step on step `step`'s data; the global batch's loss before it."""
        self.optimizer.zero_grad()
        loss = self.forward_backward(step)
        self.optimizer.step()
        return loss

    def forward_backward(self, step: int) -> float:
        raise NotImplementedError

    def held(self) -> dict[str, torch.Tensor]:
        """The tensors this rank holds, whole, by stored name as in the step's index (model/NAME,
        optimizer/state/NAME/FIELD; DTensors gathered: a collective, for the test's comparison only)."""
        from torch.distributed.tensor import DTensor

        def whole(t: torch.Tensor) -> torch.Tensor:
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().contiguous()

        out = {f"model/{self.stored(n)}": whole(p) for n, p in self.model.named_parameters()}
        for n, p in self.model.named_parameters():
            for field, value in self.optimizer.state[p].items():
                out[f"optimizer/state/{self.stored(n)}/{field}"] = whole(torch.as_tensor(value))
        return out


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(IN, H), nn.Tanh(), nn.Linear(H, F), nn.Tanh(), nn.Linear(F, H), nn.Tanh(), nn.Linear(H, 1))


class Fsdp2(Strategy):
    """Data parallel over every rank, parameters sharded (FSDP2)."""

    def mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (self.world,))

    def build(self) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        model = mlp()
        init_by_name(model, self.stored)
        mesh = self.mesh()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def forward_backward(self, step: int) -> float:
        x, y = regression_batch(step)
        loss = nn.functional.mse_loss(self.model(rows(x, self.rank, self.world)), rows(y, self.rank, self.world))
        loss.backward()  # FSDP2 averages the gradients over the ranks
        return mean_over_ranks(loss)


class Hsdp(Fsdp2):
    """FSDP2 with replicas: a 2-D mesh (replicate 2, shard world/2)."""

    def mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (2, self.world // 2), mesh_dim_names=("replicate", "shard"))


class TensorParallel(Strategy):
    """fc1 column-parallel, fc2 row-parallel over every rank (DTensor); the rest replicated."""

    def build(self) -> nn.Module:
        model = nn.Module()
        model.inp, model.fc1, model.fc2, model.head = nn.Linear(IN, H), nn.Linear(H, F), nn.Linear(F, H), nn.Linear(H, 1)
        init_by_name(model, self.stored)
        if self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (self.world,))
            parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return model

    def forward_backward(self, step: int) -> float:
        m = self.model
        x, y = regression_batch(step)
        h = torch.tanh(m.inp(x))
        loss = nn.functional.mse_loss(m.head(h + m.fc2(torch.tanh(m.fc1(h)))), y)
        loss.backward()
        return loss.item()  # every rank computed the same loss


class Stage(nn.Module):
    """Pipeline stage `s` of `world`: layers [s*per, (s+1)*per) under their global names, the
    embedding on the first stage, the output layer on the last, one tied tensor at PP=1. Its
    input: tokens on the first stage, else the previous stage's activations; its output: logits
    on the last stage, else activations."""

    def __init__(self, s: int, world: int) -> None:
        super().__init__()
        per = LAYERS // world
        self.layers = nn.ModuleDict({str(i): nn.Linear(H, H) for i in range(s * per, (s + 1) * per)})
        if s == 0:
            self.embed = nn.Embedding(V, H)
        if s == world - 1:
            self.lm_head = nn.Linear(H, V, bias=False)
            if s == 0:
                self.lm_head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed"):
            x = self.embed(x)
        for layer in self.layers.values():
            x = x + torch.tanh(layer(x))
        return self.lm_head(x) if hasattr(self, "lm_head") else x


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


class Pipeline(Strategy):
    """PP = world: torch.distributed.pipelining's GPipe schedule over the stages, MICROBATCHES
    micro-batches; the tied embedding's and output layer's gradients summed after each step."""

    strict = "missing"
    MICROBATCHES = 2

    def __init__(self, rank: int, world: int) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        super().__init__(rank, world)
        self.first, self.last = rank == 0, rank == world - 1
        self.tied = dist.new_group([0, world - 1]) if world > 1 else None  # every rank makes the group
        stage = PipelineStage(self.model, rank, world, torch.device("cpu"))
        self.schedule = ScheduleGPipe(stage, self.MICROBATCHES, loss_fn=next_token_loss)

    def build(self) -> nn.Module:
        stage = Stage(self.rank, self.world)
        init_by_name(stage, self.stored)
        return stage

    def client_options(self) -> dict[str, Any]:
        from ckptd.client.layout import LayoutRules, RankCoords, Rule, StoredAs

        return {"layout": LayoutRules([Rule(r"lm_head\.weight", StoredAs("embed.weight"))]), "coords": RankCoords(0, 1)}

    def stored(self, name: str) -> str:
        return "embed.weight" if name == "lm_head.weight" else name

    def forward_backward(self, step: int) -> float:
        g = torch.Generator().manual_seed(200 + step)
        tokens = torch.randint(0, V, (BATCH, SEQ + 1), generator=g)
        inputs = (tokens[:, :-1],) if self.first else ()
        losses: list[torch.Tensor] = []
        self.schedule.step(*inputs, target=tokens[:, 1:] if self.last else None, losses=losses)
        if self.tied is not None and (self.first or self.last):  # the tied copies' gradients summed
            tied = self.model.embed.weight if self.first else self.model.lm_head.weight
            dist.all_reduce(tied.grad, group=self.tied)
        loss = torch.stack(losses).mean() if self.last else torch.zeros(())
        if self.world > 1:
            dist.broadcast(loss, self.world - 1)
        return loss.item()


class ExpertParallel(Strategy):
    """EP = world: E experts, E/world per rank under local indices; the router picks one expert
    per token; the dense parts are replicated and data parallel."""

    strict = "missing"

    def build(self) -> nn.Module:
        model = nn.Module()
        model.inp, model.router, model.head = nn.Linear(IN, H), nn.Linear(H, E, bias=False), nn.Linear(H, 1)
        model.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, F), nn.Tanh(), nn.Linear(F, H)) for _ in range(E // self.world)])
        init_by_name(model, self.stored)
        return model

    def client_options(self) -> dict[str, Any]:
        from ckptd.client.layout import Expert, LayoutRules, RankCoords, Rule

        rules = LayoutRules([Rule(r"experts\.(\d+)\..*", Expert(num_experts=E))])
        return {"layout": rules, "coords": RankCoords(0, 1, ep_rank=self.rank, ep_size=self.world)}

    def stored(self, name: str) -> str:
        parts = name.split(".")
        if parts[0] == "experts":
            parts[1] = str(self.rank * (E // self.world) + int(parts[1]))
        return ".".join(parts)

    def local_experts(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """This rank's experts, by local index."""
        return list(self.model.experts)

    def forward_backward(self, step: int) -> float:
        m, per = self.model, BATCH // self.world
        x, y = regression_batch(step)
        h = torch.tanh(m.inp(rows(x, self.rank, self.world)))
        every = torch.zeros(BATCH, H)
        every = every.index_copy(0, torch.arange(self.rank * per, (self.rank + 1) * per), h)
        tokens = AllReduceSum.apply(every)  # every rank's tokens (the others' rows are zero)
        gate = torch.softmax(m.router(tokens), dim=-1)
        choice = gate.argmax(dim=-1)
        out = torch.zeros(BATCH, H)
        experts = self.local_experts()
        for local, expert in enumerate(experts):
            e = self.rank * len(experts) + local
            out = out + torch.where((choice == e)[:, None], gate[:, e : e + 1] * expert(tokens), 0.0)
        moe = AllReduceSum.apply(out)  # one expert per token: the sum adds zeros only
        pred = m.head(h + rows(moe, self.rank, self.world))
        loss = nn.functional.mse_loss(pred, rows(y, self.rank, self.world))
        loss.backward()
        for name, p in m.named_parameters():  # the mean over ranks: dense parts summed, experts already are
            if not name.startswith("experts.") and self.world > 1:
                dist.all_reduce(p.grad)
            p.grad.div_(self.world)
        return mean_over_ranks(loss)


class ExpertParallelDTensor(ExpertParallel):
    """The same MoE block with the experts stacked: experts.w1 (E, F, H) and experts.w2 (E, H, F),
    DTensors with Shard(0) on the expert dimension over every rank (no layout rule)."""

    strict = True

    def build(self) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        model = nn.Module()
        model.inp, model.router, model.head = nn.Linear(IN, H), nn.Linear(H, E, bias=False), nn.Linear(H, 1)
        init_by_name(model, self.stored)
        mesh, per = init_device_mesh("cpu", (self.world,)), E // self.world
        model.experts = nn.Module()
        for name, shape in (("w1", (E, F, H)), ("w2", (E, H, F))):
            whole = values(f"experts.{name}", shape)
            local = whole[self.rank * per : (self.rank + 1) * per].clone()
            dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride())
            model.experts.register_parameter(name, nn.Parameter(dt))
        return model

    def client_options(self) -> dict[str, Any]:
        return {}

    def stored(self, name: str) -> str:
        return name

    def local_experts(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        w1, w2 = self.model.experts.w1.to_local(), self.model.experts.w2.to_local()  # their gradients come back as DTensors
        return [lambda t, j=j: torch.tanh(t @ w1[j].T) @ w2[j].T for j in range(w1.shape[0])]


STRATEGIES: dict[str, type[Strategy]] = {
    "fsdp2": Fsdp2, "hsdp": Hsdp, "tp": TensorParallel, "pp": Pipeline, "ep": ExpertParallel, "ep-dtensor": ExpertParallelDTensor,
}


def save_held(strategy: Strategy, path: Path) -> None:
    save_file(strategy.held(), str(path))


def train(spec: dict, strategy: Strategy) -> None:
    from ckptd.client import CheckpointClient

    rank, out, kill = spec["rank"], Path(spec["out"]), spec.get("kill")
    state = {"model": strategy.model, "optimizer": strategy.optimizer}
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60, **strategy.client_options()) as ckpt:
        start = ckpt.load(state, strict=strategy.strict) or 0
        handle = None
        for step in range(start + 1, spec["steps"] + 1):
            loss = strategy.train_step(step)
            if rank == 0:
                with open(out / "losses.jsonl", "a") as log:
                    log.write(json.dumps({"step": step, "loss": loss, "resumed_from": start}) + "\n")
            handle = ckpt.save(step, state)
            if kill is not None and kill["rank"] == rank and step == kill["step"]:
                assert handle.wait_durable(timeout=60) is not None
            if kill is not None and kill["rank"] == rank and step == kill["step"] + 1:
                os.kill(os.getpid(), signal.SIGKILL)  # this step copied, its commit on the helper thread
        assert handle is None or handle.wait_durable(timeout=60) is not None
    save_held(strategy, out / f"saved-{rank}.safetensors")
    if spec.get("reference"):
        fresh = STRATEGIES[spec["strategy"]](rank, spec["world_size"])
        losses = {step: fresh.train_step(step) for step in range(1, spec["steps"] + 1)}
        save_held(fresh, out / f"reference-{rank}.safetensors")
        losses[spec["steps"] + 1] = fresh.train_step(spec["steps"] + 1)
        if rank == 0:
            (out / "reference.json").write_text(json.dumps(losses))


def check(spec: dict, strategy: Strategy) -> None:
    from ckptd.client import CheckpointClient

    rank, out = spec["rank"], Path(spec["out"])
    state = {"model": strategy.model, "optimizer": strategy.optimizer}
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60, **strategy.client_options()) as ckpt:
        assert ckpt.load(state, step=spec["steps"], strict=strategy.strict) == spec["steps"]
    save_held(strategy, out / f"loaded-{rank}.safetensors")
    loss = strategy.train_step(spec["steps"] + 1)
    if rank == 0:
        (out / "next_loss.json").write_text(json.dumps(loss))


def body(spec: dict) -> None:
    strategy = STRATEGIES[spec["strategy"]](spec["rank"], spec["world_size"])
    (train if spec["mode"] == "train" else check)(spec, strategy)


if __name__ == "__main__":
    run_rank(body)
