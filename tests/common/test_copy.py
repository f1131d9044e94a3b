"""ckptd.common._copy.stream_copy copies every byte, whatever the alignment and length, and
refuses buffers it cannot write or whose lengths differ; populate maps a mapping's pages and
changes nothing."""

from __future__ import annotations

import mmap
import resource
import tempfile

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


# issue 31 item 7: many small pieces in one call (arena_copy's small tensors)
@pytest.mark.parametrize("streaming", [True, False])
def test_copy_many_puts_every_piece_at_its_offset_and_nothing_else_changes(streaming: bool) -> None:
    rng = np.random.default_rng(7)
    lengths = [0, 1, 63, 64, 65, 1000, 4096 + 17]
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    offsets, at = [], 3
    for n in lengths:
        offsets.append(at)
        at += n + 5  # gaps that must keep their bytes
    dst = np.full(at, 0xAB, dtype=np.uint8)
    _copy.copy_many(dst, offsets, [s.ctypes.data for s in sources], lengths, streaming)
    expected = np.full(at, 0xAB, dtype=np.uint8)
    for offset, s in zip(offsets, sources):
        expected[offset : offset + len(s)] = s
    assert np.array_equal(dst, expected)


def test_copy_many_refuses_a_range_outside_the_destination_before_copying_anything() -> None:
    src = np.arange(8, dtype=np.uint8)
    dst = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match=r"bytes \[4, 12\) are outside the destination of 10 bytes"):
        _copy.copy_many(dst, [0, 4], [src.ctypes.data, src.ctypes.data], [2, 8], True)
    assert not dst.any()
    with pytest.raises(ValueError, match="same length"):
        _copy.copy_many(dst, [0], [src.ctypes.data], [1, 2], True)
    with pytest.raises(ValueError, match=r"offsets\[0\] is negative"):
        _copy.copy_many(dst, [-1], [src.ctypes.data], [1], True)
    with pytest.raises(TypeError, match="read-write"):
        _copy.copy_many(b"abcd", [0], [src.ctypes.data], [1], False)


# issue 33 item 5: a restore from the daemon's memory in one call, split over threads
def _pieces(lengths: list[int], seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, n + 16, dtype=np.uint8) for n in lengths]
    targets = [np.full(n + 16, 0xAB, dtype=np.uint8) for n in lengths]
    return sources, targets


@pytest.mark.parametrize("threads", [1, 2, 3, 7, 1000])
# the last two add up to STREAM_PIECES_ABOVE or more: copied by streaming stores
@pytest.mark.parametrize(
    "lengths",
    [[], [0], [5], [0, 1, 63, 64, 65, 4096 + 17], [3 * 2**20 + 5, 1, 2**20, 0, 7], [2**20 // 3] * 40,
     [9 * 2**20 + 3, 1, 7 * 2**20 + 61, 0, 5, 63], [2**24 // 7 + 3] * 8],
)
def test_copy_pieces_moves_every_byte_of_every_piece_and_nothing_else(threads: int, lengths: list[int]) -> None:
    sources, targets = _pieces(lengths, len(lengths) + threads)
    shift = 3  # unaligned starts
    _copy.copy_pieces(
        np.array([t.ctypes.data + shift for t in targets], dtype=np.uint64),
        np.array([s.ctypes.data + 1 for s in sources], dtype=np.uint64),
        np.array(lengths, dtype=np.uint64),
        threads,
    )
    for n, s, t in zip(lengths, sources, targets):
        assert np.array_equal(t[shift : shift + n], s[1 : 1 + n])
        assert (t[:shift] == 0xAB).all() and (t[shift + n :] == 0xAB).all()


def test_copy_pieces_streams_only_large_copies() -> None:
    """Below a few MiB the trainer reads the restored bytes from the cache: memcpy keeps them there."""
    assert 4 * 2**20 < _copy.STREAM_PIECES_ABOVE <= 64 * 2**20
    assert sum([9 * 2**20 + 3, 1, 7 * 2**20 + 61, 0, 5, 63]) >= _copy.STREAM_PIECES_ABOVE


def test_copy_pieces_refuses_arrays_of_other_lengths_or_itemsizes_and_no_threads() -> None:
    one = np.zeros(1, np.uint64)
    with pytest.raises(ValueError, match="uint64 arrays of one length"):
        _copy.copy_pieces(one, one, np.zeros(2, np.uint64), 1)
    with pytest.raises(ValueError, match="uint64 arrays of one length"):
        _copy.copy_pieces(np.zeros(3, np.uint8), np.zeros(3, np.uint8), np.zeros(3, np.uint8), 1)
    with pytest.raises(ValueError, match="threads=0 must be at least 1"):
        _copy.copy_pieces(one, one, one, 0)


def _read_faults(mapping: mmap.mmap) -> int:
    """Minor page faults this process takes reading one byte of every page of `mapping`."""
    view = np.frombuffer(mapping, dtype=np.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    total = int(view[:: mmap.PAGESIZE].sum())
    del view
    assert total >= 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("offset", [0, 1, 5000])
def test_populate_fills_the_page_tables_of_a_fresh_mapping_and_changes_nothing(offset: int) -> None:
    size = 16 * 2**20
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="ckptd-test-") as f:
        f.write(bytes(range(256)) * (size // 256))
        f.flush()
        fresh = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        cold_faults = _read_faults(fresh)
        fresh.close()
        mapping = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        _copy.populate(mapping, offset, size - offset)
        assert _read_faults(mapping) * 4 < cold_faults  # the pages were mapped already
        assert mapping[:512] == bytes(range(256)) * 2 and mapping[-256:] == bytes(range(256))
        with pytest.raises(ValueError, match="not inside"):
            _copy.populate(mapping, offset, size - offset + 1)
        with pytest.raises(ValueError, match="not inside"):
            _copy.populate(mapping, -1, 10)
        _copy.populate(mapping, size, 0)  # nothing: allowed
        mapping.close()
        with pytest.raises(ValueError):
            _copy.populate(mapping, 0, 1)  # unmapped: refused, never read
