"""The checks of a daemon's several-node settings that no single setting's parser can make:
node rank against the peer list, the shared secret, the peer port's TLS files together."""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = ["MIN_TOKEN_CHARS", "peer_problems"]

MIN_TOKEN_CHARS: Final = 16


def peer_problems(node_rank: int, peers: tuple[str, ...], peer_token: str, tls_files: tuple[Path | None, Path | None, Path | None]) -> list[str]:
    """What is wrong with these several-node settings (DaemonConfig's fields of those names;
    tls_files: cert, key, CA), one message per problem saying what to fix; [] when nothing."""
    tls = dict(zip(("--peer-tls-cert", "--peer-tls-key", "--peer-tls-ca"), tls_files))
    given = [flag for flag, value in tls.items() if value is not None]
    if given and len(given) < len(tls):
        missing = [flag for flag in tls if flag not in given]
        return [f"{', '.join(given)} without {', '.join(missing)}: TLS on the peer port needs this daemon's certificate, its key and the CA, all three"]
    if not peers:
        if node_rank != 0:
            return [f"--node-rank {node_rank} needs --peers: the daemon-to-daemon address of every node, in node-rank order"]
        return []
    problems = []
    if node_rank >= len(peers):
        problems.append(
            f"--node-rank {node_rank} is not a position in --peers, which lists {len(peers)} nodes (0..{len(peers) - 1})"
        )
    if len(set(peers)) != len(peers):
        problems.append(f"--peers lists an address twice: {','.join(peers)}; give each node its own host:port")
    if len(peers) > 1 and len(peer_token) < MIN_TOKEN_CHARS:
        problems.append(
            f"several nodes need a shared secret of at least {MIN_TOKEN_CHARS} characters in --peer-token or "
            f"CKPTD_PEER_TOKEN (e.g. `openssl rand -hex 32`), the same on every node"
        )
    return problems
