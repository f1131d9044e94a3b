"""ckptd.common.sizes: the one formatter of byte counts in messages (issue 30 finding 1: a
refused arena said "268435456.0 MiB")."""

from __future__ import annotations

import pytest

from ckptd.common.sizes import human_bytes


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (10 * 2**20, "10 MiB"),
        (2**20 - 1, "1 MiB"),  # 1023.999 KiB rounds into the next unit, never "1024 KiB"
        (int(1.5e9), "1.4 GiB"),
        (2**48, "256 TiB"),  # a 2^46-element fp32 tensor
        (3 * 2**60, "3 EiB"),
        (-1536, "-1.5 KiB"),
        (2.5 * 2**30, "2.5 GiB"),  # rates are floats
    ],
)
def test_human_bytes(nbytes: float, text: str) -> None:
    assert human_bytes(nbytes) == text
