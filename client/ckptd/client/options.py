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
    """Every setting of a CheckpointClient but its job (CheckpointClient's docstring says what each does).

    address: the daemon's Unix socket, "unix:///path.sock" or the bare path (None: $CKPTD_ADDRESS,
    else the default socket). rank, world_size: None, from torch.distributed, else $RANK /
    $WORLD_SIZE (ckptd.client.rank_and_world). mode: "auto", "copy", "overlap" or "ipc". on_error:
    "warn" or "raise". timeout_s: seconds a save or load may wait for the other ranks (> 0).
    copy_threads: threads of the shared-memory copy (None or 0: min(4, cores)). layout, coords:
    manual sharding rules and this rank's place in tensor parallelism (both or neither).
    local_world_size: the job's ranks on this node (None: $LOCAL_WORLD_SIZE, else all). read_files:
    None, True or False. run_config: a JSON-able dict. run_id: this run's id (None: $CKPTD_RUN_ID,
    else derived). retention: the job's JobRetention.

    Raises ValueError or TypeError, saying what to pass, for a value that cannot work.
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
        if self.copy_threads is not None and self.copy_threads < 0:
            raise ValueError(f"copy_threads={self.copy_threads}: pass the number of copy threads (>= 1), or None for min(4, cores)")
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


def options_from_keywords(caller: str, keywords: Mapping[str, Any], reserved: Collection[str] = (), **settings: Any) -> ClientOptions:
    """The ClientOptions of `caller` (an integration): its own `settings` and the CheckpointClient
    keywords it passes on (`keywords`, a **kwargs). TypeError naming the unknown keywords, and
    those `reserved` (the caller sets them itself), with the ones it takes."""
    allowed = sorted(set(FIELDS) - set(reserved) - set(settings))
    unknown = sorted(set(keywords) - set(allowed))
    if unknown:
        raise TypeError(f"{caller} got unknown keyword arguments {unknown}; CheckpointClient options are {allowed}")
    return ClientOptions(**settings, **keywords)
