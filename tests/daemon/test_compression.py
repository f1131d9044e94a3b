"""The compression decision of a save (engine/compression.py), as a table."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.daemon.plan.compression import SaveOptions, decide_compression

KEEP, DROP = "keep", "drop"


@pytest.mark.parametrize(
    ("options", "lineage", "default_quantize", "default_master", "limit", "quantize", "master", "record", "capped"),
    [
        # nothing asked, lossless defaults: nothing to record
        (SaveOptions(), 0, "none", KEEP, 1, None, KEEP, None, False),
        # the daemon's default applies when the ranks do not choose
        (SaveOptions(), 0, "O1", KEEP, 1, "O1", KEEP, {"generation": 1, "quantize": "O1", "master_weights": KEEP}, False),
        # the ranks' choice wins over the default; no_quantize wins over both
        (SaveOptions(quantize="O2"), 0, "O1", KEEP, 1, "O2", KEEP, {"generation": 1, "quantize": "O2", "master_weights": KEEP}, False),
        (SaveOptions(no_quantize=True), 0, "O1", KEEP, 1, None, KEEP, None, False),
        (SaveOptions(master_weights=DROP), 0, "none", KEEP, 0, None, DROP, {"generation": 1, "quantize": None, "master_weights": DROP}, False),
        # the compounding guard: a lineage at the limit saves losslessly, and records its depth
        (SaveOptions(quantize="O1", master_weights=DROP), 1, "none", KEEP, 1, None, KEEP, {"generation": 1, "quantize": None, "master_weights": KEEP}, True),
        # below the limit, or no limit: lossy again, one generation deeper
        (SaveOptions(quantize="O1"), 1, "none", KEEP, 2, "O1", KEEP, {"generation": 2, "quantize": "O1", "master_weights": KEEP}, False),
        (SaveOptions(quantize="O1"), 5, "none", KEEP, 0, "O1", KEEP, {"generation": 6, "quantize": "O1", "master_weights": KEEP}, False),
        # residual master weights are not lossy by themselves: no generation added, no cap
        (SaveOptions(master_weights="residual"), 1, "none", KEEP, 1, None, "residual", {"generation": 1, "quantize": None, "master_weights": "residual"}, False),
    ],
)
def test_the_compression_of_a_save(
    options: SaveOptions, lineage: int, default_quantize: str, default_master: str, limit: int,
    quantize: str | None, master: str, record: dict[str, Any] | None, capped: bool,
) -> None:
    decided = decide_compression(options, lineage, default_quantize, default_master, limit)
    assert (decided.quantize, decided.master_weights, decided.record, decided.capped) == (quantize, master, record, capped)
