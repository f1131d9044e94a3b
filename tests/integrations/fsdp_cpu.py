"""Accelerate's FSDP2 on CPU with gloo, for the tests of ckptd.integrations.accelerate and
.transformers (issue 31 item 1).

Accelerate 1.15 never selects FSDP on a CPU: `AcceleratorState.__init__` turns an `fsdp_plugin`
(or ACCELERATE_USE_FSDP=true, or the Trainer's `fsdp=`) into DistributedType.FSDP only when the
process group's type is one of MULTI_GPU/MLU/SDAA/MUSA/NPU/XPU/HPU/NEURON
(accelerate/state.py:986-1013); with `cpu=True` (the Trainer's use_cpu=True) the type is
MULTI_CPU (state.py:800-808), so the plugin is dropped without a word and the model is wrapped in
DDP. Everything after that choice works on CPU with gloo (`fully_shard`, DTensor, Accelerate's own
sharded save_state through DCP): torch 2.13's FSDP2 does.

`fsdp_on_cpu()` makes that one choice for the library: it sets up the process group with
Accelerate's own PartialState (gloo, CPU), presents it as MULTI_GPU while the Accelerator (or the
Trainer, which makes one) reads it, then records it as FSDP, the type Accelerate would have given
it on a GPU. Nothing else of Accelerate or the Trainer is replaced. `fsdp_on_cpu("MULTI_GPU")` does the same for a
ParallelismConfig with tensor parallel only (a model transformers' DistributedConfig sharded at
load time), which Accelerate refuses on MULTI_CPU (accelerate/parallelism_config.py:390-397): the
type stays MULTI_GPU, as on GPUs. On a GPU machine none of this is needed: tests/gpu/fsdp2_accelerate.sh runs the same checks with NCCL.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator


DEVICE_ENV = "CKPTD_TEST_DEVICE"  # "cuda": the workers run on GPUs with NCCL and Accelerate's own choice


def on_gpus() -> bool:
    """Whether the workers run on GPUs (tests/gpu/fsdp2_accelerate.sh sets CKPTD_TEST_DEVICE=cuda)."""
    return os.environ.get(DEVICE_ENV) == "cuda"


@contextmanager
def fsdp_on_cpu(then: str = "FSDP") -> Iterator[None]:
    """Within: make the Accelerator (or Trainer) whose FSDP plugin Accelerate should honour on CPU
    (on GPUs, CKPTD_TEST_DEVICE=cuda: nothing to do). `then`: the DistributedType recorded after,
    "FSDP", or "MULTI_GPU" for a ParallelismConfig without FSDP (tensor or expert parallel: a
    model loaded with transformers' DistributedConfig), which Accelerate refuses on MULTI_CPU
    (accelerate/parallelism_config.py:390-397) and keeps as MULTI_GPU on GPUs."""
    if on_gpus():
        yield
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)  # torch.distributed with gloo, from the environment (RANK, WORLD_SIZE, ...)
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(f"fsdp_on_cpu needs a gloo process group of several CPU processes, got {state.distributed_type}")
    state.distributed_type = DistributedType.MULTI_GPU  # read by AcceleratorState.__init__ (state.py:986)
    try:
        yield
    finally:
        state.distributed_type = DistributedType[then]  # what later AcceleratorState() copies read


def fsdp2_accelerator(**kwargs: Any) -> Any:
    """An Accelerator with the FSDP2 plugin (sharded state dict) over this CPU process group."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
    with fsdp_on_cpu():
        accelerator = Accelerator(cpu=not on_gpus(), fsdp_plugin=plugin, **kwargs)
    if not accelerator.is_fsdp2:
        raise RuntimeError(f"the Accelerator is {accelerator.distributed_type}, not FSDP2")
    return accelerator


def full_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """Every rank: the model's parameters and the optimizer's tensor states as full tensors
    (DTensor.full_tensor, a collective), keyed by parameter name; for comparing states across
    world sizes in the tests, never on the save path."""
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    names = {id(p): name for name, p in model.named_parameters()}
    out = {f"model/{k}": full(v).detach().cpu().clone() for k, v in model.state_dict().items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                out[f"optimizer/{names[id(p)]}/{key}"] = full(value).detach().cpu().clone()
    return out


def collectives_during(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """Call fn(*args, **kwargs); returns its result and the names of the collective operations
    (torch.distributed's c10d and functional collectives, as DTensor.full_tensor uses) that ran
    in this process meanwhile, seen through a TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
                self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        result = fn(*args, **kwargs)
    return result, seen.names
