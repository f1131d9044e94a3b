"""A wrapped model (DDP, torch.compile) is stored under its bare names, as its optimizer state is,
and a checkpoint resumes across wrapping in both directions (issue 20, finding 7)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckptd.client import CheckpointClient
from ckptd.demo.process import DaemonProcess


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


class Counter(nn.Module):
    """A module with extra state (restored through load_state_dict, not by the in-place fill)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def get_extra_state(self) -> dict:
        return {"count": self.count}

    def set_extra_state(self, state: dict) -> None:
        self.count = state["count"]


class Net(nn.Module):
    """A user's own submodule named "module" (not a DDP wrapper: its prefix stays), a buffer, extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 8)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, 3))
        self.counter = Counter()
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.module(x)) * self.scale


BARE_NAMES = {"module.weight", "module.bias", "head.1.weight", "head.1.bias", "scale"}


@pytest.fixture
def process_group(port: int) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trained(wrap: Callable[[nn.Module], nn.Module], seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(bare model, wrapped model, AdamW over it) after one step; the counter set to the seed."""
    torch.manual_seed(seed)
    bare = Net()
    bare.counter.count = seed
    with torch.no_grad():
        bare.scale.mul_(seed)
    wrapped = wrap(bare)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    bare(torch.randn(5, 4)).sum().backward()
    opt.step()
    return bare, wrapped, opt


def _fresh(wrap: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    bare = Net()
    wrapped = wrap(bare)
    return bare, wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.5)


def _ddp(model: nn.Module) -> nn.Module:
    return DistributedDataParallel(model)


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model)  # an OptimizedModule: never run here


def _bare(model: nn.Module) -> nn.Module:
    return model


def _tensor_keys(step_dir: Path, prefix: str) -> set[str]:
    keys: set[str] = set()
    for path in sorted(step_dir.glob(f"{prefix}*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


def _assert_same(saved: tuple[nn.Module, nn.Module, torch.optim.Optimizer], loaded: tuple[nn.Module, nn.Module, torch.optim.Optimizer]) -> None:
    (saved_bare, _, saved_opt), (loaded_bare, _, loaded_opt) = saved, loaded
    saved_sd, loaded_sd = saved_bare.state_dict(), loaded_bare.state_dict()
    assert set(BARE_NAMES) <= set(loaded_sd)
    for name in BARE_NAMES:
        assert torch.equal(loaded_sd[name], saved_sd[name]), name
    assert loaded_bare.counter.count == saved_bare.counter.count
    assert loaded_opt.param_groups[0]["lr"] == saved_opt.param_groups[0]["lr"]
    saved_params = dict(saved_bare.named_parameters())
    for name, param in loaded_bare.named_parameters():
        want, got = saved_opt.state[saved_params[name]], loaded_opt.state[param]
        assert set(got) == set(want), name
        for field in want:
            assert torch.equal(torch.as_tensor(got[field]), torch.as_tensor(want[field])), (name, field)


def test_ddp_model_is_stored_under_the_names_of_its_optimizer_state(daemon, process_group) -> None:
    bare, model, opt = _trained(_ddp, seed=3)
    with CheckpointClient("ddp-names", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(1, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
    step_dir = Path(info.step_dir)
    model_keys = _tensor_keys(step_dir, "model")
    assert model_keys == BARE_NAMES
    index = json.loads((step_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == BARE_NAMES
    optimizer_keys = _tensor_keys(step_dir, "optimizer")
    optimizer_fqns = {key.split("/")[2] for key in optimizer_keys if key.startswith("optimizer/state/")}
    assert optimizer_fqns == {name for name, _ in bare.named_parameters()}
    assert optimizer_fqns <= model_keys


@pytest.mark.parametrize(
    ("save_wrap", "load_wrap"),
    [(_ddp, _bare), (_bare, _ddp), (_compiled, _bare), (_bare, _compiled), (_ddp, _compiled)],
    ids=["ddp-to-bare", "bare-to-ddp", "compiled-to-bare", "bare-to-compiled", "ddp-to-compiled"],
)
def test_resume_across_wrapping(daemon, process_group, save_wrap, load_wrap) -> None:
    saved = _trained(save_wrap, seed=7)
    with CheckpointClient(f"across-{save_wrap.__name__}-{load_wrap.__name__}", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": saved[1], "optimizer": saved[2]}).wait_durable(timeout=60)
        loaded = _fresh(load_wrap)
        assert ckpt.load({"model": loaded[1], "optimizer": loaded[2]}) == 1
    _assert_same(saved, loaded)


def test_compiled_model_files_have_the_bare_names(daemon) -> None:
    _, model, opt = _trained(_compiled, seed=5)
    with CheckpointClient("compiled-names", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(1, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
    assert _tensor_keys(Path(info.step_dir), "model") == BARE_NAMES


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(x))


def test_ddp_tied_model_loads_into_a_bare_untied_one(daemon, process_group) -> None:
    """The optimizer state of a tied parameter gets its other (bare) FQNs as aliases under DDP too."""
    torch.manual_seed(0)
    tied = Tied()
    model = DistributedDataParallel(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tied(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    untied = Tied()
    untied.out.weight = nn.Parameter(torch.zeros(6, 4))
    untied_opt = torch.optim.AdamW(untied.parameters(), lr=0.5)
    with CheckpointClient("tied", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
        ckpt.load({"model": untied, "optimizer": untied_opt})
    assert torch.equal(untied.embed.weight, tied.embed.weight)
    assert torch.equal(untied.out.weight, tied.embed.weight)
    want = opt.state[tied.embed.weight]["exp_avg"]
    assert torch.equal(untied_opt.state[untied.embed.weight]["exp_avg"], want)
    assert torch.equal(untied_opt.state[untied.out.weight]["exp_avg"], want)
