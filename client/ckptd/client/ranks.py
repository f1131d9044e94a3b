"""This process's rank and world size, resolved one way for the client and the integrations."""

from __future__ import annotations

import os
from typing import Mapping

import torch


def rank_and_world(rank: int | None = None, world_size: int | None = None, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size): each as given, else torch.distributed's when it is initialized, else
    $RANK / $WORLD_SIZE, else 0 / 1. Not checked against each other (the caller does)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank() if rank is None else rank,
                torch.distributed.get_world_size() if world_size is None else world_size)
    environ = os.environ if env is None else env
    env_rank = env_int("RANK", 0, environ) if rank is None else rank
    env_world = env_int("WORLD_SIZE", 1, environ) if world_size is None else world_size
    return env_rank, env_world


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """The integer in environment variable `name` (unset or empty: `default`); ValueError
    naming the variable when it holds something else."""
    text = (os.environ if env is None else env).get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not an integer: set it to this process's {_MEANING.get(name, 'value')}, or unset it") from None


_MEANING = {"RANK": "global rank", "WORLD_SIZE": "number of ranks", "LOCAL_WORLD_SIZE": "number of ranks on this node"}
