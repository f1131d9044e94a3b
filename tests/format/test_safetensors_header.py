"""safetensors headers (ckptd.format.safetensors_header): golden bytes of what ckptd writes, read
by the safetensors library; what it reads refused unless it follows the format as that library
does (duplicate keys, wrong types, overlaps and holes: a file that is two things at once)."""

import struct

import pytest
import torch
from safetensors.torch import load as st_load

from ckptd.format.index import FormatError
from ckptd.format.safetensors_header import parse_safetensors_header, safetensors_header


def test_header_golden_bytes() -> None:
    header, entries = safetensors_header([("a", "F32", (2,)), ("b", "BF16", (1, 3))])
    text = b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,3],"data_offsets":[8,14]}}'
    pad = b" " * (-(len(text) + 8) % 8)
    assert header == struct.pack("<Q", len(text) + len(pad)) + text + pad
    assert len(header) % 8 == 0
    assert [(e.key, e.begin, e.end) for e in entries] == [("a", 0, 8), ("b", 8, 14)]


def test_header_is_read_by_the_safetensors_library() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1, 2, 3], dtype=torch.int64)
    header, _ = safetensors_header([("a", "F32", (2, 3)), ("b", "I64", (3,))])
    loaded = st_load(header + a.numpy().tobytes() + b.numpy().tobytes())
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)
    data_start, entries = parse_safetensors_header(header)
    assert data_start == len(header) and entries["b"].begin == 24


def test_a_header_padded_into_reserved_room_is_still_read() -> None:
    """A header written last, into room reserved before the data (codes whose size was known
    only once coded), is padded with spaces to exactly that room."""
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    header, _ = safetensors_header([("a", "F32", (2, 3))], size=200)
    assert len(header) == 200 and header.endswith(b" ")
    assert torch.equal(st_load(header + a.numpy().tobytes())["a"], a)
    with pytest.raises(FormatError, match="does not fit the 64 bytes reserved"):
        safetensors_header([("a", "F32", (2, 3))], size=64)


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"\x01", "too short"),
        (struct.pack("<Q", 1 << 40), "larger than"),
        (struct.pack("<Q", 4) + b"nope", "not JSON"),
        (struct.pack("<Q", 48) + b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'[:48], "not JSON"),
    ],
)
def test_malformed_headers_are_refused(blob: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        parse_safetensors_header(blob)


def test_wrong_size_entry_is_refused() -> None:
    text = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'
    with pytest.raises(FormatError, match="4 bytes for F32"):
        parse_safetensors_header(struct.pack("<Q", len(text)) + text)


def _file(header: str, data: bytes) -> bytes:
    text = header.encode()
    return struct.pack("<Q", len(text)) + text + data


F32_2 = '{"dtype":"F32","shape":[2],"data_offsets":[%d,%d]}'


@pytest.mark.parametrize(
    "header, data, message",
    [
        ("[]", b"", "a JSON list, not an object of tensors"),
        ('{"a":%s,"a":%s}' % (F32_2 % (0, 8), F32_2 % (8, 16)), bytes(16), "names 'a' twice"),
        ('{"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}}', bytes(8), "names 'dtype' twice"),
        ('{"a":5}', b"", "entry 'a' is malformed: 5"),
        ('{"a":{"dtype":"F32","shape":[true,2],"data_offsets":[0,8]}}', bytes(8), "entry 'a' is malformed"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8.0]}}', bytes(8), "entry 'a' is malformed"),
        ('{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', bytes(8), "entry 'a' is malformed"),
        ('{"a":{"dtype":"F32","shape":[18446744073709551616,0],"data_offsets":[0,0]}}', b"", "shape of integers in"),  # no bytes, yet no tensor has it
        ('[' * 100000 + ']' * 100000, b"", "header is not JSON: nested too deep"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}', bytes(8), "entry 'a' is malformed"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}}', bytes(8), "entry 'a' is malformed"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,NaN]}}', bytes(8), "holds NaN"),
        ('{"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}}', bytes(8), "entry 'a' is malformed"),
        ('{"__metadata__":{"format":1},"a":%s}' % (F32_2 % (0, 8)), bytes(8), "must map strings to strings"),
        ('{"__metadata__":["pt"],"a":%s}' % (F32_2 % (0, 8)), bytes(8), "must map strings to strings"),
        ('{"a":%s,"b":%s}' % (F32_2 % (0, 8), F32_2 % (4, 12)), bytes(12), "'a' and 'b' overlap"),
        ('{"a":%s}' % (F32_2 % (4, 12)), bytes(12), "bytes 0-4 of the data belong to no tensor"),
        ('{"a":%s,"b":%s}' % (F32_2 % (0, 8), F32_2 % (12, 20)), bytes(20), "bytes 8-12 of the data belong to no tensor"),
        ('{"a":%s}' % (F32_2 % (0, 8)), bytes(12), "the last 4 bytes of the file belong to no tensor"),
        ('{"a":%s}' % (F32_2 % (0, 8)), bytes(4), "'a' ends past the end of the file"),
    ],
)
def test_a_header_that_breaks_the_format_is_refused_with_what_is_wrong(header: str, data: bytes, message: str) -> None:
    blob = _file(header, data)
    with pytest.raises(FormatError, match=message):
        parse_safetensors_header(blob, len(blob))


def test_what_the_format_allows_is_read() -> None:
    """Entries in any order, empty tensors anywhere, metadata of strings, no metadata, no tensors."""
    header = '{"b":%s,"__metadata__":{"format":"pt"},"e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},"a":%s}' % (F32_2 % (8, 16), F32_2 % (0, 8))
    blob = _file(header, bytes(16))
    start, entries = parse_safetensors_header(blob, len(blob))
    assert start == len(blob) - 16 and [(k, e.begin, e.end) for k, e in entries.items()] == [("b", 8, 16), ("e", 8, 8), ("a", 0, 8)]
    assert parse_safetensors_header(_file("{}", b""), 8 + 2)[1] == {}
    assert parse_safetensors_header(_file('{"__metadata__":{}}', b""))[1] == {}
