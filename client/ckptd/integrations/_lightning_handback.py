"""The trained weights that DDP started by multiprocessing hands back to the main process (for
ckptd.integrations.lightning).

Lightning's _MultiProcessingLauncher (strategy="ddp_spawn", "ddp_fork", "ddp_notebook") ends a
fit with the model's bare state_dict saved through the CheckpointIO on local rank 0 of the
worker processes, into a file in a new temporary directory; the main process loads that file
through the CheckpointIO, puts it into its own module (load_state_dict(strict=False)) and
removes it (lightning/pytorch/strategies/launchers/multiprocessing.py,
_collect_rank_zero_results and _recover_results_in_main_process). It is no checkpoint and never
reaches the daemon: CkptdCheckpointIO writes it as one safetensors file (JSON header, raw
bytes; nothing pickled) and reads it back. Pure file I/O, no Lightning import.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch

from ckptd.common import dtypes, json_read

FORMAT = "ckptd-lightning-handback"
_LENGTH = 8  # the header's length, little-endian, before the header (safetensors)


def write_weights(path: str, state_dict: Mapping[str, Any]) -> None:
    """Write `state_dict` (names -> tensors) to a new file at `path`, fsynced.

    Raises TypeError naming an entry that is not a tensor or has a dtype ckptd does not store,
    FileExistsError when `path` exists.
    """
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    payload: list[torch.Tensor] = []
    offset = 0
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"the trained weights handed back to the main process hold {name!r}, a {type(value).__name__}: "
                "CkptdCheckpointIO hands back tensors only (a module's extra state is not handed back)"
            )
        tensor = value.detach().to("cpu").contiguous()
        try:
            dtype = dtypes.from_torch_name(str(tensor.dtype).removeprefix("torch."))
        except dtypes.UnknownDtypeError as exc:
            raise TypeError(f"the trained weights handed back to the main process: {name!r}: {exc}") from None
        data = tensor.reshape(-1).view(torch.uint8)
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + data.numel()]}
        payload.append(data)
        offset += data.numel()
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the bytes start 8-aligned, as safetensors writes them
    with open(path, "xb") as f:
        f.write(len(encoded).to_bytes(_LENGTH, "little"))
        f.write(encoded)
        for data in payload:
            f.write(data.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The state_dict write_weights wrote at `path`, in its order. Raises ValueError for a file
    it did not write."""
    with open(path, "rb") as f:
        data = f.read()
    length = int.from_bytes(data[:_LENGTH], "little")
    try:
        header = json_read.loads(data[_LENGTH : _LENGTH + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.pop("__metadata__", None) != {"format": FORMAT}:
        raise ValueError(f"{path} is not the trained weights that CkptdCheckpointIO hands back to the main process")
    body = memoryview(data)[_LENGTH + length :]
    state: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        raw = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.uint8) if end > begin else torch.empty(0, dtype=torch.uint8)
        state[name] = raw.view(getattr(torch, dtypes.torch_name(entry["dtype"]))).reshape(entry["shape"])
    return state
