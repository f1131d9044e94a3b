"""The trainer's half of a checkpoint's environment record (environment.json in the step).

Rank 0 sends it with each save; the daemon adds the layout that wrote the step and its own
version (daemon step_build.environment_json), and `ckptd inspect` shows the whole record.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

MAX_RUN_CONFIG_BYTES = 256 * 1024  # the daemon takes model files of up to 1 MiB


def check_run_config(run_config: Any) -> dict[str, Any] | None:
    """`run_config` if it is None or a JSON-able dict of at most MAX_RUN_CONFIG_BYTES; else
    ValueError/TypeError saying what to change."""
    if run_config is None:
        return None
    if not isinstance(run_config, dict):
        raise TypeError(f"run_config must be a dict of JSON-able values (e.g. your hyperparameters), got {type(run_config).__name__}")
    try:
        text = json.dumps(run_config, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"run_config must be JSON-able (str, numbers, bools, None, lists, dicts): {exc}") from None
    if len(text) > MAX_RUN_CONFIG_BYTES:
        raise ValueError(f"run_config is {len(text)} bytes as JSON; the limit is {MAX_RUN_CONFIG_BYTES}: keep it to the settings of the run")
    return run_config


def _installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def meshes_of(tensors: Iterable[torch.Tensor]) -> list[dict[str, Any]]:
    """The distinct device meshes of the DTensors among `tensors`: shape, dimension names and
    the placements seen on them."""
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for t in tensors:
        if not isinstance(t, DTensor):
            continue
        mesh = t.device_mesh
        key = (tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()), mesh.device_type)
        doc = found.setdefault(key, {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ()), "device_type": mesh.device_type, "placements": []})
        placements = [str(p) for p in t.placements]
        if placements not in doc["placements"]:
            doc["placements"].append(placements)
    return list(found.values())


def trainer_environment(run_config: dict[str, Any] | None, meshes: list[dict[str, Any]], tp_size: int | None) -> str:
    """The record rank 0 sends, as JSON text: versions, platform, meshes, tensor parallelism of
    layout rules (tp_size, when used) and the user's run config."""
    doc: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ckptd": _installed("ckptd"),
        "platform": sys.platform,
        "cuda": torch.version.cuda,
        "device_meshes": meshes,
    }
    if tp_size is not None:
        doc["tensor_parallel"] = tp_size
    if run_config is not None:
        doc["run_config"] = run_config
    return json.dumps(doc, sort_keys=True)
