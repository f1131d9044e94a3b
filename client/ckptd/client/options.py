"""ClientOptions: how a CheckpointClient connects and hands over, checked once where it is made.

`CheckpointClient(job, **keywords)` builds one from its keywords; `CheckpointClient(job,
options=ClientOptions(...))` takes one made up front, as the integrations do: they check what the
user passed when they are constructed, not at the first save. What depends on the process (the
rank and world size when not given, the default address, $LOCAL_WORLD_SIZE, $CKPTD_RUN_ID) is
resolved by the client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Collection, Mapping

from ckptd.client._handoff.modes import AUTO, resolve_mode
from ckptd.client.environment import check_run_config
from ckptd.client.layout import LayoutRules, RankCoords
from ckptd.common.names import check_run_id
from ckptd.common.paths import daemon_address
from ckptd.common.retention import JobRetention, check_job_retention

__all__ = ["ClientOptions", "ON_ERROR", "options_from_keywords"]

ON_ERROR = ("warn", "raise")


@dataclass(frozen=True)
class ClientOptions:
    """Every setting of a CheckpointClient but its job, checked once, here.

    address: the daemon's socket (its `--socket`), "unix:///path.sock" or the bare path (default:
    $CKPTD_ADDRESS, else the default socket; anything but a Unix socket raises ValueError saying
    what to write). rank/world_size: default from torch.distributed, else $RANK/$WORLD_SIZE
    (ckptd.client.rank_and_world).
    on_error: "warn" (default: a failed save is logged and returned as a failed handle, training
    goes on) or "raise". It covers what can pass (a daemon that is down, a full disk, a timeout,
    an aborted save); a state that can never be saved (an optimizer without its model, a value
    of an unsupported type, a bad tensor name, a meta or sparse tensor) raises on the first save
    whatever it says: ValueError or TypeError, or InvalidState when the daemon refuses the
    state's metadata, with the message that says how to fix it. timeout_s: how long a save or
    load may wait for the other ranks (seconds, > 0).
    layout, coords: rules for manually sharded (Megatron-style) tensors and this rank's place in
    tensor parallelism (ckptd.client.layout); DTensors need none. retention: the job's JobRetention (docs/operations.md, "Retention").
    local_world_size: how many of the job's ranks use this node's daemon; needed when the job
    spans several nodes (default: $LOCAL_WORLD_SIZE, which torchrun sets, else all ranks).
    read_files: how loads get bytes from disk: True, read the committed files directly (the
    storage root must be visible here); False, the daemon copies what is needed into shared
    memory first (a trainer container without the storage volume); None (default), read
    directly when this process can open the files, else go through the daemon.
    run_config: the run's settings (a JSON-able dict: hyperparameters, data, launcher), kept in
    each checkpoint's environment record (environment.json, shown by `ckptd inspect`) beside
    the versions of Python, torch and ckptd and the layout that wrote it.
    mode: how CUDA tensors are handed over (ckptd.client._handoff): "auto" (= "overlap"), "copy",
    "overlap" or "ipc"; CPU tensors always take the plain shared-memory copy. `mode_in_use` and
    `mode_reason` say what is used now and why it differs from the request (a fallback).
    run_id: this run's id, the same on every rank and new at every start of the program (default:
    $CKPTD_RUN_ID, else derived: ckptd.client.run_id). The daemon refuses the saves of a second
    run of the job while the first is live, unless it resumed: loaded a step of the job before
    its first save (docs/usage.md, "Job identity").
    copy_threads: threads of the shared-memory copy (None or 0: min(4, cores)).

    Raises ValueError or TypeError, saying what to pass, for a value that cannot work; what
    depends on the process (the rank against the world size, $LOCAL_WORLD_SIZE, $CKPTD_RUN_ID) is
    checked by the client.
    """

    address: str | None = None
    rank: int | None = None
    world_size: int | None = None
    mode: str = AUTO
    on_error: str = "warn"
    timeout_s: float = 600.0
    copy_threads: int | None = None
    layout: LayoutRules | None = None
    coords: RankCoords | None = None
    local_world_size: int | None = None
    read_files: bool | None = None
    run_config: dict[str, Any] | None = None
    run_id: str | None = None
    retention: JobRetention | None = None

    def __post_init__(self) -> None:
        resolve_mode(self.mode)
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}: use 'warn' or 'raise' (warn: a failed save is logged, training goes on)")
        if self.address:  # "" or None: $CKPTD_ADDRESS, else the default socket
            daemon_address(self.address)
        for name in ("rank", "world_size", "local_world_size", "copy_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name}={value!r}: pass an integer, or None")
            if value is not None and name != "copy_threads" and not 0 <= value < MAX_RANKS:
                raise ValueError(f"{name}={value}: pass a number from 0 to {MAX_RANKS - 1}")
        if self.copy_threads is not None and self.copy_threads < 0:
            raise ValueError(f"copy_threads={self.copy_threads}: pass the number of copy threads (>= 1), or None (or 0) for min(4, cores)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s={self.timeout_s!r}: pass the seconds a save or load may wait for the other ranks (> 0)")
        if self.read_files not in (None, True, False):
            raise ValueError(f"read_files={self.read_files!r}: use None (read committed files when this process can), True or False")
        if self.layout is not None and self.coords is None:
            raise ValueError("layout rules need coords=RankCoords(tp_rank, tp_size): where this rank sits in tensor parallelism")
        check_run_config(self.run_config)
        if self.run_id is not None:
            check_run_id(self.run_id)
        check_job_retention(self.retention)


FIELDS = tuple(f.name for f in fields(ClientOptions))
MAX_RANKS = 2**31  # ranks and world sizes are int32 on the wire


def options_from_keywords(caller: str, keywords: Mapping[str, Any], reserved: Collection[str] = (), **settings: Any) -> ClientOptions:
    """The ClientOptions of `caller` (an integration): its own `settings` and the CheckpointClient
    keywords it passes on (`keywords`, a **kwargs). TypeError naming the unknown keywords, and
    those `reserved` (the caller sets them itself), with the ones it takes."""
    allowed = sorted(set(FIELDS) - set(reserved) - set(settings))
    unknown = sorted(set(keywords) - set(allowed))
    if unknown:
        raise TypeError(f"{caller} got unknown keyword arguments {unknown}; CheckpointClient options are {allowed}")
    return ClientOptions(**settings, **keywords)
