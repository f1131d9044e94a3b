"""The hand-off mode names: the only place they are spelled (docs/architecture.md, the client).

`CheckpointClient(mode=...)` takes one of MODES; it applies to CUDA tensors only. CPU tensors
always take the plain shared-memory copy, reported as CPU on the save's handle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("ckptd.client")

CPU = "cpu"  # SaveHandle.mode of a state without CUDA tensors (the shared-memory copy)
AUTO = "auto"  # picks OVERLAP
COPY = "copy"  # device-to-host copies; save() waits for them
OVERLAP = "overlap"  # the same copies; save() returns at once, a fence guards the state
IPC = "ipc"  # device-to-device into a staging buffer the daemon drains; falls back to OVERLAP
MODES = (AUTO, COPY, OVERLAP, IPC)
FALLBACK = OVERLAP


def resolve_mode(requested: str) -> str:
    """The mode CUDA tensors take for `requested` (before any fallback). Raises ValueError."""
    if requested not in MODES:
        raise ValueError(f"mode={requested!r}: use one of {', '.join(MODES)}")
    return OVERLAP if requested == AUTO else requested


@dataclass
class ModeState:
    """The mode CUDA tensors take now, and why it is not the one asked for (None: it is)."""

    requested: str
    in_use: str
    reason: str | None = None

    def fall_back(self, reason: str) -> None:
        """Use FALLBACK from now on; log why once."""
        if self.in_use != FALLBACK:
            log.warning("ckptd mode %r cannot work here, using %r: %s", self.in_use, FALLBACK, reason)
            self.in_use = FALLBACK
            self.reason = reason
