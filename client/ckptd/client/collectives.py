"""Small torch.distributed helpers the client's collectives share: where a collective's tensor
lives, and an all-gather whose results come back on the CPU."""

from __future__ import annotations

import torch


def collective_device(group: torch.distributed.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective over `group` must live: the CPU for gloo (or without
    CUDA), else the current CUDA device (NCCL takes only device tensors)."""
    backend = str(torch.distributed.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_to_cpu(tensor: torch.Tensor, group: torch.distributed.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape and dtype on all ranks of `group`), in group rank order, on the CPU."""
    size = torch.distributed.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(out, tensor, group=group)
    return [t.cpu() for t in out]
