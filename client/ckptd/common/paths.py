"""Default locations shared by the daemon and the client, and the check of an export's output directory."""

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
    """What a client connects to: $CKPTD_ADDRESS, else the default socket (as `daemon_address` reads it)."""
    env = os.environ if environ is None else environ
    return daemon_address(env.get("CKPTD_ADDRESS") or f"unix://{default_socket(env)}")


def daemon_address(address: str) -> str:
    """A client's address of its daemon, as gRPC takes it. The daemon serves ranks on its Unix
    socket only (`ckptd serve --socket PATH`), so the address is that socket: "unix:///abs/path.sock"
    (or gRPC's "unix:relative.sock", "unix-abstract:NAME") as it is, or the socket's bare path
    ("/run/ckptd/ckptd.sock", "./ckptd.sock"). Raises ValueError naming the address and what to
    write for anything else (a host:port, another scheme)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return address
    if address.startswith("/"):
        return f"unix://{address}"
    if address and ":" not in address:
        return f"unix:{address}"  # a relative path
    raise ValueError(
        f"ckptd address {address!r} is not a Unix socket: the daemon serves ranks on its socket only (`ckptd serve "
        "--socket PATH`); set CKPTD_ADDRESS (or address=) to unix:///path/to/ckptd.sock or to the socket's path"
    )


def new_directory_problem(out: Path) -> str | None:
    """Why `out` cannot be the directory an export creates (None: it can): it must not exist, or
    be an empty directory; never a link (nothing is written through one) nor a file."""
    if out.is_symlink():
        return f"{out} is a symbolic link; give a new directory (an export never writes through a link)"
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory; give a new directory"
    if out.is_dir() and any(out.iterdir()):
        return f"{out} exists and is not empty; choose a new directory"
    return None
