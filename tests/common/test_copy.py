"""ckptd.common._copy.stream_copy copies every byte, whatever the alignment and length, and
refuses buffers it cannot write or whose lengths differ."""

from __future__ import annotations

import numpy as np
import pytest

from ckptd.common import _copy


def test_the_kind_of_copy_is_named() -> None:
    assert _copy.KIND in ("avx2 streaming stores", "sse2 streaming stores", "memcpy")


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 127, 128, 1000, 4096 + 17, 3 * 2**20 + 5])
@pytest.mark.parametrize("dst_shift", [0, 1, 31, 63])
@pytest.mark.parametrize("src_shift", [0, 7])
def test_every_byte_lands_and_nothing_around_it_changes(length: int, dst_shift: int, src_shift: int) -> None:
    rng = np.random.default_rng(length + 131 * dst_shift + src_shift)
    src = rng.integers(0, 256, length + 64, dtype=np.uint8)
    dst = np.full(length + 128, 0xAB, dtype=np.uint8)
    _copy.stream_copy(dst[dst_shift : dst_shift + length], src[src_shift : src_shift + length])
    assert np.array_equal(dst[dst_shift : dst_shift + length], src[src_shift : src_shift + length])
    assert (dst[:dst_shift] == 0xAB).all() and (dst[dst_shift + length :] == 0xAB).all()


def test_buffers_of_different_lengths_are_refused_with_both_lengths() -> None:
    with pytest.raises(ValueError, match="destination holds 5 bytes, source 4; they must be equal"):
        _copy.stream_copy(np.zeros(5, np.uint8), np.zeros(4, np.uint8))


def test_a_read_only_destination_is_refused() -> None:
    with pytest.raises(TypeError, match="read-write"):
        _copy.stream_copy(b"abcd", np.zeros(4, np.uint8))
    frozen = np.zeros(4, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises((TypeError, ValueError, BufferError)):
        _copy.stream_copy(frozen, np.zeros(4, np.uint8))
