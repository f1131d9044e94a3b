"""The client's wire edge (ckptd.client._rpc): one status -> error mapping, pb -> client records."""

from __future__ import annotations

import grpc
import pytest

from ckptd.client import CheckpointError, CheckpointNotFound, DaemonUnavailable, InvalidState
from ckptd.client._rpc import _source, status_error
from ckptd.common.boxes import Box
from ckptd.wire.v1 import checkpoint_pb2 as pb


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    "code, details, refusal, kind",
    [
        (grpc.StatusCode.UNAVAILABLE, "connect failed", False, DaemonUnavailable),
        (grpc.StatusCode.NOT_FOUND, "no step 3", False, CheckpointNotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad tensor name", False, CheckpointError),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad tensor name", True, InvalidState),
        (grpc.StatusCode.INVALID_ARGUMENT, "job j has a save in flight with world size 4", True, CheckpointError),
        (grpc.StatusCode.FAILED_PRECONDITION, "unknown fingerprint", True, CheckpointError),
    ],
)
def test_each_status_maps_to_one_error(code: grpc.StatusCode, details: str, refusal: bool, kind: type) -> None:
    error = status_error(Failed(code, details), "unix:///x.sock", refusal)
    assert type(error) is kind and error.code == code.name
    if kind is DaemonUnavailable:
        assert "no ckptd answers at unix:///x.sock" in str(error) and "ckptd serve" in str(error)
    else:
        assert str(error) == details


def test_a_piece_with_its_decoding_becomes_a_source() -> None:
    scales = pb.Piece(name="t", source="file", path="/s", offset=8, nbytes=16, fragment=pb.Box(offsets=[0], lengths=[4]), dtype="F32")
    piece = pb.Piece(
        name="t", source="shm", path="/a", offset=64, nbytes=4, fragment=pb.Box(offsets=[0], lengths=[4]), dtype="I8", checksum="xxh3-64:0",
        decode=pb.Decode(codec="lin-i8", block=32, scales=scales, frame_rows=2, frame_ends=[3, 4]),
    )
    src = _source(piece)
    assert (src.name, src.kind, src.path, src.offset, src.nbytes, src.box, src.dtype) == ("t", "shm", "/a", 64, 4, Box((0,), (4,)), "I8")
    assert src.decode is not None and src.decode.codec == "lin-i8" and src.decode.block == 32 and src.decode.base is None
    assert src.decode.scales is not None and src.decode.scales.path == "/s" and src.decode.scales.decode is None
    assert src.decode.frames is not None and src.decode.frames.rows == 2
