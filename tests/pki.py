"""Test certificates for mutual TLS on the peer port, made with `cryptography` (shared by
tests/integration/test_multi_node.py and tests/integration/test_peer_security.py).

Imported by name: tests/conftest.py puts tests/ on sys.path.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any

HOSTS = ("localhost", "127.0.0.1")


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _write_cert(path: Path, cert: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class Authority:
    """A CA that signs leaf certificates for 127.0.0.1 and localhost (server and client use).

    `out` holds ca.crt and ca.key; each `issue(name)` writes name.crt and name.key beside them.
    """

    def __init__(self, out: Path, name: str) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        self.out = out
        self.name = f"{name} CA"
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(_name(self.name)).issuer_name(_name(self.name))
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        out.mkdir(parents=True, exist_ok=True)
        self.ca_path = out / "ca.crt"
        _write_cert(self.ca_path, self.cert)
        _write_key(out / "ca.key", self.key)

    def issue(
        self, name: str, not_before: datetime.timedelta = datetime.timedelta(minutes=-5), not_after: datetime.timedelta = datetime.timedelta(days=1)
    ) -> dict[str, Path]:
        """A leaf certificate valid from now+not_before to now+not_after (negative: in the past).

        Returns the paths {"cert", "key", "ca"} (ca: this authority's certificate)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        now = datetime.datetime.now(datetime.timezone.utc)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder().subject_name(_name(f"ckptd {name}")).issuer_name(_name(self.name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + not_before).not_valid_after(now + not_after)
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        paths = {"cert": self.out / f"{name}.crt", "key": self.out / f"{name}.key", "ca": self.ca_path}
        _write_cert(paths["cert"], cert)
        _write_key(paths["key"], key)
        return paths


def make_pki(out: Path, name: str) -> dict[str, Path]:
    """PEM files of a new CA ("ca") and of one certificate ("cert", "key") it signed for
    127.0.0.1 and localhost, good for server and client use."""
    return Authority(out, name).issue("node")


def tls_args(pki: dict[str, Path]) -> list[str]:
    """The `ckptd serve` flags that turn on mutual TLS with these files."""
    return ["--peer-tls-cert", str(pki["cert"]), "--peer-tls-key", str(pki["key"]), "--peer-tls-ca", str(pki["ca"])]
