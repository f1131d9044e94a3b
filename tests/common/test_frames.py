"""Entropy-coded codes: zstd frames of whole rows, their table, reads of any row range."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from ckptd.common import frames
from ckptd.common.frames import FrameError, Frames


def codes(rows: int, row_bytes: int, seed: int = 0) -> np.ndarray:
    """Int4-like codes: packed nibbles concentrated near the middle, as quantized moments are."""
    rng = np.random.default_rng(seed)
    nibbles = np.clip(np.rint(rng.normal(8, 2.5, size=rows * row_bytes * 2)), 1, 15).astype(np.uint8)
    return nibbles[0::2] | (nibbles[1::2] << 4)


@pytest.mark.parametrize("rows, row_bytes, frame_bytes", [(1, 10, 1 << 20), (37, 64, 640), (100, 48, 1000), (5, 4096, 100)])
def test_every_row_range_decompresses_to_the_same_rows(rows: int, row_bytes: int, frame_bytes: int) -> None:
    data = codes(rows, row_bytes)
    stored, table = frames.compress(data, row_bytes, frame_bytes)
    assert table.rows == max(1, frame_bytes // row_bytes) and len(table.ends) == -(-rows // table.rows)
    assert table.nbytes == len(stored)
    for r0 in range(rows):
        for r1 in {r0 + 1, min(rows, r0 + 3), rows}:
            f0, f1, begin, end = table.span(r0, r1)
            got = frames.decompress(stored[begin:end], table, f0, f1, row_bytes, rows)
            first = r0 - f0 * table.rows
            assert np.array_equal(got[first * row_bytes : (first + r1 - r0) * row_bytes], data[r0 * row_bytes : r1 * row_bytes])


def test_frames_are_plain_zstd_and_take_bytes_off_skewed_codes() -> None:
    data = codes(64, 1024)
    stored, table = frames.compress(data, 1024, 16 * 1024)
    assert len(table.ends) == 4 and len(stored) < 0.9 * len(data)
    first = zstandard.ZstdDecompressor().decompress(stored[: table.ends[0]].tobytes())
    assert first == data[: 16 * 1024].tobytes()  # any zstd tool reads a frame


def test_the_table_round_trips_through_json() -> None:
    table = Frames(7, (10, 25, 31))
    assert Frames.from_json(table.to_json()) == table
    assert table.to_json() == {"coder": "zstd", "rows": 7, "ends": [10, 25, 31]}


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"coder": "brotli", "rows": 1, "ends": [1]}, "unknown entropy coder 'brotli'"),
        ({"coder": "zstd", "rows": 0, "ends": [1]}, "malformed frame table"),
        ({"coder": "zstd", "rows": 2, "ends": [5, 5]}, "malformed frame table"),
    ],
)
def test_a_bad_table_is_refused(doc: dict, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        Frames.from_json(doc)


def test_rows_outside_the_frames_and_damaged_frames_are_errors() -> None:
    data = codes(10, 100)
    stored, table = frames.compress(data, 100, 300)
    with pytest.raises(FrameError, match="rows \\[10, 13\\) are not in 4 frames of 3 rows"):
        table.span(10, 13)
    damaged = stored.copy()
    damaged[5] ^= 0xFF
    with pytest.raises(FrameError, match="frame 0"):
        frames.decompress(damaged[: table.ends[0]], table, 0, 1, 100, 10)
    with pytest.raises(FrameError, match="whole rows of 100 bytes"):
        frames.compress(data[:150], 100)
