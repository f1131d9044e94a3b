"""Filling trainer tensors from stored fragments (ckptd.client.reader: fill, pieces, decode): whole and
partial (resharded), from files and arenas.

Fragments are written as raw bytes at offsets of a real file (after a fake header, as in a
safetensors file) or of a real arena (a file in /dev/shm mapped by ArenaMaps).
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import torch
import xxhash

from ckptd.client.reader import pieces
from ckptd.client.arenas import ArenaMaps
from ckptd.client.reader.pieces import Decoding, Source
from ckptd.client.reader.fill import Fill, fill_all
from ckptd.client.errors import CheckpointError
from ckptd.common import dtypes
from ckptd.common.boxes import Box, relative
from ckptd.common.chunks import ChunkHasher
from ckptd.common.reshard import shard_boxes
from ckptd.format.file_plan import CHECKED_SOURCE

HEADER = 136  # bytes before the first fragment, like a safetensors header


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as p:
        yield p


@pytest.fixture
def maps() -> Iterator[ArenaMaps]:
    m = ArenaMaps()
    yield m
    m.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator["Store"]:
    s = Store(tmp_path)
    yield s
    s.close()


class Store:
    """Writes fragments of a tensor into a file ("file") or an arena in /dev/shm ("shm")."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.arenas: list[str] = []

    def put(self, kind: str, name: str, whole: torch.Tensor, boxes: list[Box], chunk_bytes: int = 0) -> list[Source]:
        """Store box after box of `whole` back to back after HEADER bytes; return their sources
        (with the checksums of chunks of `chunk_bytes`, if not 0)."""
        if kind == "shm":
            fd, path = tempfile.mkstemp(prefix="ckptd-test-transport-", dir="/dev/shm")
            os.close(fd)
            self.arenas.append(path)
        else:
            path = str(self.tmp_path / f"{name.replace('/', '_')}-{len(boxes)}.safetensors")
        dtype = dtypes.from_torch_name(str(whole.dtype))
        full = Box.full(tuple(whole.shape))
        sources = []
        with open(path, "wb") as f:
            f.write(b"{" * HEADER)
            for box in boxes:
                data = whole[relative(box, full)].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                checksum = f"xxh3-64:{xxhash.xxh3_64_intdigest(data):016x}"
                chunks = ChunkHasher(chunk_bytes) if chunk_bytes else None
                if chunks is not None:
                    chunks.update(data)
                sources.append(Source(name, kind, path, f.tell(), len(data), box, dtype, checksum, chunk_bytes, chunks.hexdigests() if chunks else ""))
                f.write(data)
            f.write(b"}" * 64)
        return sources

    def close(self) -> None:
        for path in self.arenas:
            os.unlink(path)


def ramp(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values, exact in float32 and in bfloat16 after rounding."""
    return (torch.arange(int(torch.Size(shape).numel()), dtype=torch.float64) * 0.25 - 3).to(dtype).reshape(shape)


SHAPE = (13, 10)
WANTS = {
    "whole": Box((0, 0), (13, 10)),
    "rows": Box((2, 0), (5, 10)),
    "columns": Box((0, 3), (13, 4)),
    "block": Box((4, 2), (6, 5)),
    "one element": Box((12, 9), (1, 1)),
}
LAYOUTS = {
    "one fragment": [Box.full(SHAPE)],
    "3 row shards": shard_boxes(SHAPE, 0, 3),
    "4 column shards": shard_boxes(SHAPE, 1, 4),
    "2x2 blocks": [Box((0, 0), (7, 6)), Box((0, 6), (7, 4)), Box((7, 0), (6, 6)), Box((7, 6), (6, 4))],
}


def contiguous(want: Box, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.full(want.lengths, -99.0, dtype=dtype)
    return t, t


def transposed(want: Box, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.full(want.lengths[::-1], -99.0, dtype=dtype)
    return base.t(), base


def narrowed(want: Box, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A view into the middle of a larger tensor, like a DTensor's local view or a slice of fused QKV."""
    base = torch.full((want.lengths[0] + 3, want.lengths[1] + 5), -99.0, dtype=dtype)
    return base[1 : 1 + want.lengths[0], 2 : 2 + want.lengths[1]], base


TARGETS = {"contiguous": contiguous, "transposed": transposed, "narrowed": narrowed}


@pytest.mark.parametrize("kind", ["file", "shm", CHECKED_SOURCE])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("target_kind", TARGETS)
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
def test_fills_every_wanted_box_exactly(
    pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, kind: str, layout: str, target_kind: str, target_dtype: torch.dtype
) -> None:
    whole = ramp(SHAPE)
    sources = store.put(kind, "model/w", whole, LAYOUTS[layout])
    fills, expected = [], []
    for want in WANTS.values():
        target, base = TARGETS[target_kind](want, target_dtype)
        fills.append(Fill(target, want, sources))
        expected.append((target, base, whole[relative(want, Box.full(SHAPE))].to(target_dtype)))
    fill_all(pool, maps, fills)
    for target, base, values in expected:
        assert torch.equal(target, values)
        assert int((base == -99).sum()) == base.numel() - target.numel()  # nothing written outside the target


@pytest.mark.parametrize("kind", ["file", "shm", CHECKED_SOURCE])
def test_0_dim_and_3_dim_tensors(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, kind: str) -> None:
    scalar = torch.tensor(7, dtype=torch.int64)
    cube = ramp((5, 11, 3))
    scalar_sources = store.put(kind, "step", scalar, [Box((), ())])
    cube_sources = store.put(kind, "cube", cube, shard_boxes((5, 11, 3), 1, 3))
    out_scalar = torch.zeros((), dtype=torch.int64)
    want = Box((1, 2, 0), (3, 6, 3))
    out_cube = torch.zeros(want.lengths)
    fill_all(pool, maps, [Fill(out_scalar, Box((), ()), scalar_sources), Fill(out_cube, want, cube_sources)])
    assert int(out_scalar) == 7
    assert torch.equal(out_cube, cube[1:4, 2:8, :])


def test_a_partial_read_reads_only_the_needed_bytes(
    pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = (16, 32768)  # rows of 128 KiB: gaps between column runs are too wide to read through
    whole = ramp(shape)
    sources = store.put("file", "emb", whole, shard_boxes(shape, 0, 2))
    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        got = real_preadv(fd, buffers, offset)
        reads.append((offset, got))
        return got

    monkeypatch.setattr(pieces.os, "preadv", preadv)

    rows = Box((3, 0), (9, shape[1]))  # rows 3..11: the end of fragment 0 and the start of fragment 1
    out = torch.empty(rows.lengths)
    fill_all(pool, maps, [Fill(out, rows, sources)])
    assert torch.equal(out, whole[3:12])
    row_bytes = shape[1] * 4
    assert sorted(reads) == [(sources[0].offset + 3 * row_bytes, 5 * row_bytes), (sources[1].offset, 4 * row_bytes)]

    reads.clear()
    columns = Box((0, 1000), (16, 1024))
    out = torch.empty(columns.lengths)
    fill_all(pool, maps, [Fill(out, columns, sources)])
    assert torch.equal(out, whole[:, 1000:2024])
    assert len(reads) == 16 and all(n == 1024 * 4 for _, n in reads)
    assert sum(n for _, n in reads) == sum(s.nbytes for s in sources) // 32


def test_whole_read_with_bad_checksum_names_the_tensor(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    whole = ramp(SHAPE)
    (source,) = store.put("file", "model/layer.0.weight", whole, [Box.full(SHAPE)])
    with open(source.path, "r+b") as f:
        f.seek(source.offset + 17)
        f.write(b"\x5a")
    for target in [torch.empty(SHAPE), transposed(Box.full(SHAPE), torch.float32)[0], torch.empty(SHAPE, dtype=torch.bfloat16)]:
        with pytest.raises(CheckpointError, match=r"checksum mismatch for tensor 'model/layer.0.weight'"):
            fill_all(pool, maps, [Fill(target, Box.full(SHAPE), [source])])


# issue 34: a piece the daemon checked as it arrived (a replica staged in shared memory) is
# copied as it is, whole, in parts or strided, small or large: the rank does not hash it again.
@pytest.mark.parametrize("shape", [SHAPE, (9 * 2**20 // 4 // 1024, 1024)], ids=["small", "over SPLIT_BYTES"])
@pytest.mark.parametrize("want", ["whole", "rows", "columns"])
def test_a_piece_the_daemon_checked_is_copied_without_hashing_it_again(
    pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], want: str
) -> None:
    whole = ramp(shape)
    box = {"whole": Box.full(shape), "rows": Box((1, 0), (shape[0] - 2, shape[1])), "columns": Box((0, 3), (shape[0], 4))}[want]
    (source,) = store.put(CHECKED_SOURCE, "model/w", whole, [Box.full(shape)], chunk_bytes=4096)

    def no_hashing(*args: object) -> None:
        raise AssertionError("a piece the daemon checked was hashed again")

    monkeypatch.setattr(pieces.xxhash, "xxh3_64", no_hashing)
    monkeypatch.setattr(pieces, "digest_of", no_hashing)
    out = torch.full(box.lengths, -99.0)
    fill_all(pool, maps, [Fill(out, box, [source])])
    assert torch.equal(out, whole[relative(box, Box.full(shape))])


def test_the_same_damaged_bytes_fail_a_file_piece_and_pass_as_a_checked_one(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    """The contract of CHECKED_SOURCE: the daemon vouches for the bytes (it never marks a range it
    did not check before writing it: tests/daemon/test_staging_checks.py), so the rank's check is skipped."""
    whole = ramp(SHAPE)
    (source,) = store.put("file", "model/w", whole, [Box.full(SHAPE)])
    with open(source.path, "r+b") as f:
        f.seek(source.offset + 17)
        f.write(b"\x5a")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        fill_all(pool, maps, [Fill(torch.empty(SHAPE), Box.full(SHAPE), [source])])
    fill_all(pool, maps, [Fill(torch.empty(SHAPE), Box.full(SHAPE), [source._replace(kind=CHECKED_SOURCE)])])


@pytest.mark.parametrize("kind", ["file", "shm", CHECKED_SOURCE])
def test_many_row_slices_small_and_large_fill_exactly(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, kind: str) -> None:
    """The fast path of row slices: many small ones (batched), and large ones (split over the
    threads; from an arena through its mapping, first fresh, then again)."""
    wholes = [ramp((31 + i, 6)) + i for i in range(40)] + [ramp((5 * 2**20 // 4 // 256 + 4, 256))]
    sources = [store.put(kind, f"t{i}", w, shard_boxes(tuple(w.shape), 0, 2)) for i, w in enumerate(wholes)]
    wants = [Box((w.shape[0] // 4, 0), (w.shape[0] // 2 + 1, w.shape[1])) for w in wholes]  # across the two fragments
    for _ in range(2):
        outs = [torch.full(want.lengths, -99.0) for want in wants]
        fill_all(pool, maps, [Fill(out, want, src) for out, want, src in zip(outs, wants, sources)])
        for out, want, w in zip(outs, wants, wholes):
            assert torch.equal(out, w[relative(want, Box.full(tuple(w.shape)))])


def test_small_pieces_from_more_arenas_than_are_kept_mapped_copy_exactly(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    """ArenaMaps keeps 8 arenas mapped; pieces copied by address from 20 arenas must still come
    from their own arena (every mapping used stays mapped until the copies are done)."""
    wholes = [ramp((16, 8)) + i for i in range(20)]
    sources = [store.put("shm", f"t{i}", w, [Box.full((16, 8))]) for i, w in enumerate(wholes)]
    for want in (Box.full((16, 8)), Box((3, 0), (9, 8))):
        outs = [torch.full(want.lengths, -99.0) for _ in wholes]
        fill_all(pool, maps, [Fill(out, want, src) for out, src in zip(outs, sources)])
        for out, w in zip(outs, wholes):
            assert torch.equal(out, w[relative(want, Box.full((16, 8)))])


@pytest.mark.parametrize("kind", ["file", "shm", CHECKED_SOURCE])
def test_a_row_slice_of_a_piece_of_another_size_than_its_box_is_an_error(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, kind: str) -> None:
    (source,) = store.put(kind, "model/w", ramp(SHAPE), [Box.full(SHAPE)])
    with pytest.raises(CheckpointError, match="has 516 bytes for a target of 520"):
        fill_all(pool, maps, [Fill(torch.empty(ROWS_2_TO_7.lengths), ROWS_2_TO_7, [source._replace(nbytes=source.nbytes - 4)])])


ROWS_2_TO_7 = Box((2, 0), (5, 10))


def test_a_checked_piece_of_another_size_than_its_target_is_an_error(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    shape = (5 * 2**20 // 4 // 256, 256)
    (source,) = store.put(CHECKED_SOURCE, "model/w", ramp(shape), [Box.full(shape)])
    with pytest.raises(CheckpointError, match="has .* bytes for a target of"):
        fill_all(pool, maps, [Fill(torch.empty(shape), Box.full(shape), [source._replace(nbytes=source.nbytes - 4)])])


@pytest.mark.parametrize("damage_at", [None, 3, 200, 519])
def test_reads_hashed_a_slice_at_a_time_check_every_byte(
    pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, monkeypatch: pytest.MonkeyPatch, damage_at: int | None
) -> None:
    """A checked read hashes each slice as it is read (HASH_SLICE, here 64 bytes: 520 bytes are
    9 slices, the last one short): the digest is the whole fragment's, and a damaged byte in any
    slice is found, whether the fragment is read straight into the target or through runs."""
    monkeypatch.setattr(pieces, "HASH_SLICE", 64)
    whole = ramp(SHAPE)
    (source,) = store.put("file", "w", whole, [Box.full(SHAPE)])
    fragments = store.put("file", "v", whole, shard_boxes(SHAPE, 1, 2))  # column halves: read through runs
    if damage_at is not None:
        for src in (source, fragments[1]):
            with open(src.path, "r+b") as f:
                f.seek(src.offset + min(damage_at, src.nbytes - 1))
                f.write(b"\xff")  # no byte of these values is 0xff
    fills = [Fill(torch.empty(SHAPE), Box.full(SHAPE), [source]), Fill(torch.empty(SHAPE), Box.full(SHAPE), fragments)]
    for fill in fills:
        if damage_at is None:
            fill_all(pool, maps, [fill])
            assert torch.equal(fill.target, whole)
        else:
            with pytest.raises(CheckpointError, match="checksum mismatch for tensor"):
                fill_all(pool, maps, [fill])


def test_a_fragment_scattered_whole_into_the_target_is_verified(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    whole = ramp(SHAPE)
    sources = store.put("file", "w", whole, shard_boxes(SHAPE, 1, 2))  # column shards, restored whole: one run per row
    with open(sources[1].path, "r+b") as f:
        f.seek(sources[1].offset + 30)
        f.write(b"\x5a")
    with pytest.raises(CheckpointError, match="checksum mismatch for tensor 'w'"):
        fill_all(pool, maps, [Fill(torch.empty(SHAPE), Box.full(SHAPE), sources)])


def test_truncated_file_and_wrong_target_shape_are_errors(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    whole = ramp(SHAPE)
    (source,) = store.put("file", "w", whole, [Box.full(SHAPE)])
    os.truncate(source.path, source.offset + 100)
    with pytest.raises(CheckpointError, match="truncated"):
        fill_all(pool, maps, [Fill(torch.empty(SHAPE), Box.full(SHAPE), [source])])
    with pytest.raises(CheckpointError, match="truncated"):
        fill_all(pool, maps, [Fill(torch.empty(3, 10), Box((5, 0), (3, 10)), [source])])
    with pytest.raises(CheckpointError, match="has shape \\[10, 13\\]"):
        fill_all(pool, maps, [Fill(torch.empty(10, 13), Box.full(SHAPE), [source])])


@pytest.mark.parametrize("kind", ["file", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_column_slice_of_many_rows_is_placed_by_one_strided_copy(tmp_path, kind: str, dtype: torch.dtype) -> None:
    import tempfile

    import xxhash


    full = torch.arange(300 * 7, dtype=torch.float32).reshape(300, 7)
    frag_box = Box((0, 0), (300, 7))
    data = full.numpy().tobytes()
    checksum = f"xxh3-64:{xxhash.xxh3_64_intdigest(data):016x}"
    shm_file = None
    if kind == "file":
        path = tmp_path / "f.bin"
        path.write_bytes(b"\0" * 40 + data)
        offset = 40
    else:
        shm_file = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="ckptd-test-")
        shm_file.write(data)
        shm_file.flush()
        path, offset = Path(shm_file.name), 0
    want = Box((10, 2), (250, 3))  # 250 runs of 3 elements
    target = torch.zeros(3, 250, dtype=dtype).T  # non-contiguous, another dtype
    source = Source("model/w", kind, str(path), offset, len(data), frag_box, "F32", checksum)
    with ThreadPoolExecutor(2) as pool:
        fill_all(pool, ArenaMaps(), [Fill(target, want, [source])])
    assert torch.equal(target, full[10:260, 2:5].to(dtype))
    if shm_file is not None:
        shm_file.close()


# ------------------------------------------------------------------ chunk checksums of partial reads


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_reads_checked_by_chunks_fill_every_wanted_box_exactly(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, layout: str) -> None:
    whole = ramp(SHAPE)
    sources = store.put("file", "model/w", whole, LAYOUTS[layout], chunk_bytes=48)  # 12 floats: chunks cut rows
    for want in WANTS.values():
        out = torch.zeros(want.lengths)
        fill_all(pool, maps, [Fill(out, want, sources)])
        assert torch.equal(out, whole[relative(want, Box.full(SHAPE))])


def flip_byte(source: Source, at: int) -> None:
    with open(source.path, "r+b") as f:
        f.seek(source.offset + at)
        byte = f.read(1)
        f.seek(source.offset + at)
        f.write(bytes([byte[0] ^ 0x5A]))


ROWS_3_TO_9 = Box((3, 0), (6, 10))  # fragment bytes [120, 360): chunks of 64 B 1 and 5 are cut, 2-4 inside


@pytest.mark.parametrize("at, damaged", [(200, True), (130, True), (121, True), (70, True), (370, True), (10, False), (500, False)])
def test_a_partial_read_checks_every_chunk_it_touches(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store, at: int, damaged: bool) -> None:
    """A byte flipped in a chunk the read touches is found, also outside the bytes it needs
    (the edge chunks are read whole); one in a chunk it does not touch is not read at all."""
    whole = ramp(SHAPE)
    (source,) = store.put("file", "model/w", whole, [Box.full(SHAPE)], chunk_bytes=64)
    flip_byte(source, at)
    out = torch.zeros(ROWS_3_TO_9.lengths)
    if damaged:
        with pytest.raises(CheckpointError, match=r"checksum mismatch for tensor 'model/w' .* \(chunk \d+ of the fragment\)"):
            fill_all(pool, maps, [Fill(out, ROWS_3_TO_9, [source])])
    else:
        fill_all(pool, maps, [Fill(out, ROWS_3_TO_9, [source])])
        assert torch.equal(out, whole[3:9])


@pytest.mark.parametrize(
    "kind, lo, nbytes, damage_at, damaged",
    [
        ("file", 0, 520, None, False),  # all of the fragment: its checksum
        ("file", 0, 520, 517, True),
        ("file", 120, 240, None, False),  # part of it: chunks 1 and 5 cut, 2-4 inside
        ("file", 120, 240, 200, True),  # inside
        ("file", 120, 240, 70, True),  # in the chunk cut at the start, before the range
        ("file", 120, 240, 370, True),  # in the chunk cut at the end, after the range
        ("file", 120, 240, 10, False),  # in a chunk the range does not touch
        (CHECKED_SOURCE, 120, 240, 200, False),  # the daemon checked it: read as it is
        (CHECKED_SOURCE, 0, 520, 3, False),
    ],
)
def test_read_range_checks_as_read_runs_does_through_the_callers_descriptor(
    store: Store, kind: str, lo: int, nbytes: int, damage_at: int | None, damaged: bool
) -> None:
    whole = ramp(SHAPE)
    (source,) = store.put(kind, "model/w", whole, [Box.full(SHAPE)], chunk_bytes=64)
    if damage_at is not None:
        flip_byte(source, damage_at)
    expected = whole.reshape(-1).view(torch.uint8).numpy()[lo : lo + nbytes].copy()
    if damage_at is not None and lo <= damage_at < lo + nbytes:
        expected[damage_at - lo] ^= 0x5A
    out = torch.zeros(nbytes, dtype=torch.uint8).numpy()
    fd = pieces.open_piece(source)
    try:
        if damaged:
            with pytest.raises(CheckpointError, match="checksum mismatch for tensor 'model/w'"):
                pieces.read_range(fd, source, lo, out)
        else:
            pieces.read_range(fd, source, lo, out)
            assert (out == expected).all()
        os.fstat(fd)  # still open: the caller's to close
    finally:
        os.close(fd)


def test_a_column_slice_mapped_from_the_file_is_checked_by_chunks(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    shape = (300, 7)  # a column slice of rows 10..259 is one strided copy of a mapping of those rows
    whole = ramp(shape)
    (source,) = store.put("file", "w", whole, [Box.full(shape)], chunk_bytes=1024)
    want = Box((10, 2), (250, 3))
    out = torch.zeros(want.lengths)
    fill_all(pool, maps, [Fill(out, want, [source])])
    assert torch.equal(out, whole[10:260, 2:5])
    flip_byte(source, 9 * 28)  # row 9, outside the rows read but in the chunk cut at their start
    with pytest.raises(CheckpointError, match="checksum mismatch for tensor 'w'"):
        fill_all(pool, maps, [Fill(out, want, [source])])


def test_malformed_chunk_checksums_are_an_error_naming_the_tensor(pool: ThreadPoolExecutor, maps: ArenaMaps, store: Store) -> None:
    (source,) = store.put("file", "model/w", ramp(SHAPE), [Box.full(SHAPE)], chunk_bytes=64)
    bad = source._replace(chunk_xxh3=source.chunk_xxh3[:-1])
    with pytest.raises(CheckpointError, match="chunk checksums of tensor 'model/w' .* are malformed"):
        fill_all(pool, maps, [Fill(torch.zeros(ROWS_3_TO_9.lengths), ROWS_3_TO_9, [bad])])


@pytest.mark.parametrize("codec_name", ["lin-i4", "log-u8"])
def test_codes_in_zstd_frames_decode_any_box_like_the_whole(pool: ThreadPoolExecutor, maps: ArenaMaps, tmp_path: Path, codec_name: str) -> None:
    """Codes stored as frames of 3 rows (chunk checksums of 64 bytes): every box reads only the
    frames holding its rows and decodes as the whole tensor does; a damaged frame is an error
    naming the tensor."""
    from ckptd.common import codecs, frames

    codec = codecs.codec(codec_name, 16)
    shape = (20, 40)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(1)).abs() * 1e-3
    full = Box.full(shape)
    codes, scales = codec.encode(values, full)
    flat = codes.reshape(-1).view(torch.uint8).numpy()
    stored, table = frames.compress(flat, codes.shape[1], 3 * codes.shape[1])
    path = tmp_path / "codes.safetensors"

    def source(data: bytes, at: int, dtype: str) -> Source:
        chunks = ChunkHasher(64)
        chunks.update(data)
        return Source("m", "file", str(path), at, len(data), full, dtype, f"xxh3-64:{xxhash.xxh3_64_intdigest(data):016x}", 64, chunks.hexdigests())

    scale_bytes = scales.reshape(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(b"{" * HEADER + stored.tobytes() + scale_bytes)
    src = source(stored.tobytes(), HEADER, "U8")._replace(
        decode=Decoding(codec.name, codec.block, source(scale_bytes, HEADER + len(stored), "F32"), None, table),
    )
    whole = codec.decode(codes, scales, full, full)
    for want in (full, Box((0, 0), (1, 40)), Box((2, 5), (4, 7)), Box((3, 0), (3, 40)), Box((19, 39), (1, 1)), Box((5, 17), (11, 20))):
        target = torch.full(want.lengths, -99.0)
        fill_all(pool, maps, [Fill(target, want, [src])])
        assert torch.equal(target, whole[relative(want, full)]), want
    damaged = bytearray(path.read_bytes())
    damaged[HEADER + table.ends[1] - 2] ^= 0xFF  # inside frame 1: rows 3..5
    path.write_bytes(bytes(damaged))
    fill_all(pool, maps, [Fill(torch.empty(2, 40), Box((0, 0), (2, 40)), [src])])  # frame 0 only: fine
    with pytest.raises(CheckpointError, match="tensor 'm'.*checksum mismatch|checksum mismatch for tensor 'm'"):
        fill_all(pool, maps, [Fill(torch.empty(2, 40), Box((4, 0), (2, 40)), [src])])


@pytest.mark.parametrize(
    "paths, files, offsets, nbytes",
    [
        (["/a"], [0, 0], [0], [4, 4]),  # columns of other lengths
        (["/a"], [1], [0], [4]),  # no such arena
        (["/a"], [-1], [0], [4]),
        (["/a"], [0], [-8], [4]),  # a negative offset or size
        (["/a"], [0], [0], [-4]),
        ([], [0], [0], [4]),  # bytes in no arena
    ],
)
def test_malformed_memory_columns_are_refused_with_what_to_do(paths: list[str], files: list[int], offsets: list[int], nbytes: list[int]) -> None:
    with pytest.raises(CheckpointError, match="malformed.*upgrade the client and the daemon to the same release"):
        pieces.ArenaColumns.of(paths, files, offsets, nbytes)


def test_memory_columns_may_place_an_empty_fragment_in_no_arena() -> None:
    columns = pieces.ArenaColumns.of([], [0], [0], [0])
    assert columns.nbytes.tolist() == [0] and columns.paths == ()
