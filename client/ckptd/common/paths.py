"""Default locations shared by the daemon and the client."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def default_socket(environ: Mapping[str, str] | None = None) -> Path:
    """The daemon's default Unix socket: under $XDG_RUNTIME_DIR, else /run/ckptd as root, else /tmp/ckptd-<uid>."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "ckptd" / "ckptd.sock"
    if os.geteuid() == 0:
        return Path("/run/ckptd/ckptd.sock")
    return Path(f"/tmp/ckptd-{os.geteuid()}/ckptd.sock")


def default_root(environ: Mapping[str, str] | None = None) -> Path:
    """The daemon's default storage root: /var/lib/ckptd as root, else $XDG_DATA_HOME/ckptd or ~/.local/share/ckptd."""
    env = os.environ if environ is None else environ
    if os.geteuid() == 0:
        return Path("/var/lib/ckptd")
    data = env.get("XDG_DATA_HOME")
    return (Path(data) if data else Path.home() / ".local" / "share") / "ckptd"


def default_address(environ: Mapping[str, str] | None = None) -> str:
    """What a client connects to: $CKPTD_ADDRESS, else the default socket."""
    env = os.environ if environ is None else environ
    return env.get("CKPTD_ADDRESS") or f"unix://{default_socket(env)}"
