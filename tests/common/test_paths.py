"""ckptd.common.paths: where a client finds its daemon (issue 30 finding 11: a socket's bare path)."""

from __future__ import annotations

import pytest

from ckptd.common.paths import daemon_address, default_address


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("unix:///run/ckptd/ckptd.sock", "unix:///run/ckptd/ckptd.sock"),
        ("/run/ckptd/ckptd.sock", "unix:///run/ckptd/ckptd.sock"),  # the daemon's --socket as it is
        ("./ckptd.sock", "unix:./ckptd.sock"),
        ("sockets/d.sock", "unix:sockets/d.sock"),
        ("unix:rel.sock", "unix:rel.sock"),
        ("unix-abstract:ckptd", "unix-abstract:ckptd"),
    ],
)
def test_issue30_finding11_a_sockets_path_is_an_address(address: str, target: str) -> None:
    assert daemon_address(address) == target
    assert default_address({"CKPTD_ADDRESS": address}) == target


@pytest.mark.parametrize("address", ["localhost:50051", "dns:///node0:7000", "http://node0/ckptd.sock"])
def test_issue30_finding11_an_address_that_is_no_socket_says_what_to_write(address: str) -> None:
    with pytest.raises(ValueError, match=rf"ckptd address '{address}' is not a Unix socket.*--socket PATH.*unix:///path/to/ckptd.sock"):
        daemon_address(address)


def test_the_default_address_is_the_default_socket() -> None:
    assert default_address({"XDG_RUNTIME_DIR": "/run/user/7"}) == "unix:///run/user/7/ckptd/ckptd.sock"
