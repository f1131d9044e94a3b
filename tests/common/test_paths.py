"""ckptd.common.paths: where a client finds its daemon (issue 30 finding 11: a socket's bare path), and where an export may write."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.common.paths import daemon_address, default_address, new_directory_problem


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


def test_an_exports_directory_is_new_or_empty_never_a_link_or_a_file(tmp_path: Path) -> None:
    assert new_directory_problem(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert new_directory_problem(tmp_path / "empty") is None
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert new_directory_problem(tmp_path / "full") == f"{tmp_path / 'full'} exists and is not empty; choose a new directory"
    (tmp_path / "file").write_text("mine")
    assert "exists and is not a directory" in str(new_directory_problem(tmp_path / "file"))
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for link in ("to-empty", "dangling"):
        assert "is a symbolic link; give a new directory" in str(new_directory_problem(tmp_path / link))
