"""Mutual TLS on the daemon-to-daemon port (optional; the peer token is required either way).

Every daemon has a certificate and key signed by one CA that all daemons of the cluster trust.
The peer server asks each caller for its certificate and checks it against the CA; each daemon
checks the certificate of the peer it calls against the CA and the host name it dialled (the
certificate's subject alternative names must hold the host of that node's --peers entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ckptd.daemon.config import ConfigError

_PEM_BEGIN = b"-----BEGIN "


@dataclass(frozen=True)
class PeerTls:
    """PEM bytes: this daemon's certificate (chain), its private key, and the cluster's CA."""

    cert: bytes
    key: bytes = field(repr=False)
    ca: bytes

    @staticmethod
    def from_files(cert: Path, key: Path, ca: Path) -> "PeerTls":
        """Read the three PEM files; raise ConfigError naming the file that is missing or not PEM."""
        pems = []
        for what, path in (("--peer-tls-cert", cert), ("--peer-tls-key", key), ("--peer-tls-ca", ca)):
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from None
            if _PEM_BEGIN not in data:
                raise ConfigError(f"{what} {path}: not a PEM file (no '-----BEGIN' line); give the PEM form, e.g. from `openssl x509 -outform PEM`")
            pems.append(data)
        return PeerTls(*pems)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)
