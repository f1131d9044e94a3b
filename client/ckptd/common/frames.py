"""Entropy coding of quantized codes: independent zstd frames of whole rows (docs/architecture.md §8).

Blockwise int4/int8 codes are far from uniform (most first-moment codes sit near zero), so a
Huffman stage takes about a fifth off them. Codes are cut into frames of whole rows (dim 0 of
the stored codes), each compressed on its own, so a reader that needs rows [r0, r1) reads and
decompresses only the frames holding them. The frame table (rows per frame and where each frame
ends) is recorded in the index beside the codec; the stored bytes are the frames back to back.

Pure: bytes in, bytes out; no file system.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import zstandard

ENTROPY: Final = "zstd"  # the only entropy coder; its name in the index
FRAME_BYTES: Final = 1 << 20  # uncompressed code bytes per frame, about (frames hold whole rows)
ZSTD_LEVEL: Final = 1  # level 1 is all Huffman here (codes have no long matches); higher levels only cost time


class FrameError(ValueError):
    """A frame table that does not fit the stored bytes, or a frame that does not decompress to
    its rows: the index and the data disagree."""


@dataclass(frozen=True)
class Frames:
    """How the stored bytes of a piece's codes are cut: `rows` rows (dim 0) per frame (the last
    frame may hold fewer), frame k ends at byte `ends[k]` of the stored bytes (k = 0, 1, ...)."""

    rows: int
    ends: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.rows < 1 or any(b <= a for a, b in zip((0, *self.ends), self.ends)):
            raise FrameError(f"malformed frame table: {self.rows} rows per frame, ends {list(self.ends[:8])}...")

    @property
    def nbytes(self) -> int:
        return self.ends[-1] if self.ends else 0

    def span(self, r0: int, r1: int) -> tuple[int, int, int, int]:
        """For rows [r0, r1): (first frame, frame after the last, first byte, byte after the last)."""
        f0, f1 = r0 // self.rows, -(-r1 // self.rows)
        if not 0 <= r0 < r1 or f1 > len(self.ends):
            raise FrameError(f"rows [{r0}, {r1}) are not in {len(self.ends)} frames of {self.rows} rows")
        return f0, f1, self.ends[f0 - 1] if f0 else 0, self.ends[f1 - 1]

    def to_json(self) -> dict[str, object]:
        return {"coder": ENTROPY, "rows": self.rows, "ends": list(self.ends)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Frames":
        if d.get("coder") != ENTROPY:
            raise FrameError(f"unknown entropy coder {d.get('coder')!r}; this ckptd decodes {ENTROPY!r} frames only — upgrade ckptd")
        return Frames(int(d["rows"]), tuple(int(x) for x in d["ends"]))


def compress(codes: np.ndarray, row_bytes: int, frame_bytes: int = FRAME_BYTES) -> tuple[np.ndarray, Frames]:
    """The flat uint8 `codes` (whole rows of `row_bytes`) as zstd frames of whole rows, about
    `frame_bytes` of codes each (at least one row): (the frames back to back as a flat uint8
    array, their table)."""
    if codes.dtype != np.uint8 or codes.ndim != 1 or row_bytes < 1 or len(codes) % row_bytes:
        raise FrameError(f"codes must be flat uint8 whole rows of {row_bytes} bytes, got {codes.dtype}[{len(codes)}]")
    rows = max(1, frame_bytes // row_bytes)
    step = rows * row_bytes
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    frames = [compressor.compress(codes[i : i + step].data) for i in range(0, len(codes), step)]
    ends = np.cumsum([len(f) for f in frames]).tolist()
    return np.frombuffer(b"".join(frames), dtype=np.uint8), Frames(rows, tuple(ends))


def decompress(data: np.ndarray, frames: Frames, f0: int, f1: int, row_bytes: int, total_rows: int) -> np.ndarray:
    """The code rows of frames [f0, f1) as a flat uint8 array; `data` holds exactly those frames'
    stored bytes (Frames.span), `total_rows` is the piece's row count (the last frame is short)."""
    base = frames.ends[f0 - 1] if f0 else 0
    first_row, end_row = f0 * frames.rows, min(total_rows, f1 * frames.rows)
    out = np.empty((end_row - first_row) * row_bytes, dtype=np.uint8)
    decompressor = zstandard.ZstdDecompressor()
    cursor = 0
    for k in range(f0, f1):
        begin, end = (frames.ends[k - 1] if k else 0) - base, frames.ends[k] - base
        want = (min(total_rows, (k + 1) * frames.rows) - k * frames.rows) * row_bytes
        try:
            rows = decompressor.decompress(data[begin:end].data, max_output_size=want)
        except zstandard.ZstdError as exc:
            raise FrameError(f"frame {k} does not decompress: {exc}") from None
        if len(rows) != want:
            raise FrameError(f"frame {k} holds {len(rows)} bytes, expected {want}")
        out[cursor : cursor + want] = np.frombuffer(rows, dtype=np.uint8)
        cursor += want
    return out
