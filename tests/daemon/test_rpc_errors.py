"""The daemon's error edge, over real in-process gRPC servers: one interceptor maps domain
errors to status codes for every RPC (unary and streaming), the peer token is checked before
any Peer handler runs, and a failed call to the coordinator becomes the right domain error."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ckptd.common.names import InvalidNameError
from ckptd.daemon import errors
from ckptd.daemon.rpc.auth import PEER_TOKEN_KEY, PeerTokenInterceptor, check_token
from ckptd.daemon.rpc.errors import (
    REASON_KEY,
    RUN_REFUSED,
    STATUS,
    UNKNOWN_FINGERPRINT,
    ErrorStatusInterceptor,
    coordinator_error,
    reason_of,
    status_of,
)
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc

TOKEN = "s3cret-token-0123"


class Raising(pb_grpc.CheckpointServicer):
    """A Checkpoint servicer without any error handling of its own: `to_raise` is raised by the
    unary methods, and by WaitDurable after its first message."""

    def __init__(self) -> None:
        self.to_raise: BaseException | None = None
        self.stream_closed = asyncio.Event()

    async def BeginSave(self, request: pb.BeginSaveRequest, context: grpc.aio.ServicerContext) -> pb.BeginSaveResponse:
        if self.to_raise is not None:
            raise self.to_raise
        return pb.BeginSaveResponse(save_id="ok")

    async def LoadDone(self, request: pb.LoadDoneRequest, context: grpc.aio.ServicerContext) -> pb.LoadDoneResponse:
        await context.abort(grpc.StatusCode.OUT_OF_RANGE, "set by the handler itself")
        raise AssertionError("unreachable")

    async def WaitDurable(self, request: pb.WaitDurableRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SaveProgress]:
        try:
            yield pb.SaveProgress(state="writing")
            if self.to_raise is not None:
                raise self.to_raise
            yield pb.SaveProgress(state="committed", done=True)
        finally:
            self.stream_closed.set()


class Peer(ppb_grpc.PeerServicer):
    async def Inventory(self, request: ppb.InventoryRequest, context: grpc.aio.ServicerContext) -> ppb.InventoryResponse:
        return ppb.InventoryResponse(root_id="r", committed=True)

    async def Fetch(self, request: ppb.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[ppb.Chunk]:
        yield ppb.Chunk(data=b"abc")
        raise errors.NotFound("gone after the first chunk")


def serve(tmp_path: Path, scenario: Callable[[grpc.aio.Channel, Any], Awaitable[None]], peer: bool = False) -> None:
    async def main() -> None:
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorStatusInterceptor()]
        servicer: Any
        server = grpc.aio.server(interceptors=[*interceptors, PeerTokenInterceptor(TOKEN)] if peer else interceptors)
        if peer:
            servicer = Peer()
            ppb_grpc.add_PeerServicer_to_server(servicer, server)
        else:
            servicer = Raising()
            pb_grpc.add_CheckpointServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        address = f"unix://{tmp_path / 's.sock'}"
        server.add_insecure_port(address)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await scenario(channel, servicer)
        finally:
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("error", "code"),
    [(cls("what to fix"), code) for cls, code in STATUS.items()]
    + [
        (errors.NoSpace("disk full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (InvalidNameError("bad job id"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_each_domain_error_is_its_status_with_its_message(tmp_path: Path, error: Exception, code: grpc.StatusCode) -> None:
    async def scenario(channel: grpc.aio.Channel, servicer: Raising) -> None:
        servicer.to_raise = error
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.CheckpointStub(channel).BeginSave(pb.BeginSaveRequest())
        assert (caught.value.code(), caught.value.details()) == (code, str(error))

    serve(tmp_path, scenario)


@pytest.mark.parametrize("text", ["ranks [1, 2, 3] never started it " * 2000, "é" * 30000])
def test_a_message_too_long_for_grpcs_metadata_is_cut_not_lost(tmp_path: Path, text: str) -> None:
    """Found by an attacker's probe: a save timeout of a 4,096-rank job named every missing rank
    in its message (23 KB, the probe reported), which gRPC's 16 KiB metadata limit turned into a transport error
    (RESOURCE_EXHAUSTED) instead of the reason. The message is cut to MESSAGE_BYTES and says so."""
    async def scenario(channel: grpc.aio.Channel, servicer: Raising) -> None:
        servicer.to_raise = errors.Aborted(text)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.CheckpointStub(channel).BeginSave(pb.BeginSaveRequest())
        details = caught.value.details()
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert text.startswith(details[: details.index(" ... (")]) and details.endswith("more bytes cut)"), details[-80:]
        assert len(urllib.parse.quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")) <= errors.MESSAGE_BYTES

    serve(tmp_path, scenario)


@pytest.mark.parametrize(("values", "text"), [([], "[]"), ([3], "[3]"), (list(range(16)), str(list(range(16)))), (list(range(4096)), "[0, 1, 2, 3, ... 4096 in all]")])
def test_listed_shows_a_few_numbers_and_how_many(values: list[int], text: str) -> None:
    assert errors.listed(values, limit=16 if len(values) <= 16 else 4) == text


def test_an_unexpected_error_is_internal_names_the_rpc_and_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(channel: grpc.aio.Channel, servicer: Raising) -> None:
        servicer.to_raise = ZeroDivisionError("a bug")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.CheckpointStub(channel).BeginSave(pb.BeginSaveRequest())
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert caught.value.details() == "internal error in BeginSave: ZeroDivisionError: a bug"
        servicer.to_raise = None
        assert (await pb_grpc.CheckpointStub(channel).BeginSave(pb.BeginSaveRequest())).save_id == "ok"  # the server stays up

    with caplog.at_level(logging.ERROR, logger="ckptd.daemon.rpc.errors"):
        serve(tmp_path, scenario)
    assert any("internal error in BeginSave" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_status_the_handler_sets_itself_passes_unchanged(tmp_path: Path) -> None:
    async def scenario(channel: grpc.aio.Channel, servicer: Raising) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.CheckpointStub(channel).LoadDone(pb.LoadDoneRequest())
        assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.OUT_OF_RANGE, "set by the handler itself")

    serve(tmp_path, scenario)


def test_a_stream_ends_with_the_status_of_its_error_and_its_cleanup_runs(tmp_path: Path) -> None:
    async def scenario(channel: grpc.aio.Channel, servicer: Raising) -> None:
        servicer.to_raise = errors.Timeout("waited too long")
        call = pb_grpc.CheckpointStub(channel).WaitDurable(pb.WaitDurableRequest())
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for item in call:
                seen.append(item.state)
        assert seen == ["writing"]
        assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED, "waited too long")
        await asyncio.wait_for(servicer.stream_closed.wait(), 5)
        servicer.to_raise = None
        assert [i.state async for i in pb_grpc.CheckpointStub(channel).WaitDurable(pb.WaitDurableRequest())] == ["writing", "committed"]

    serve(tmp_path, scenario)


def test_unknown_fingerprint_is_a_typed_reason_in_the_trailing_metadata(tmp_path: Path) -> None:
    async def scenario(channel: grpc.aio.Channel, servicer: Raising) -> None:
        servicer.to_raise = errors.UnknownFingerprint()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.CheckpointStub(channel).BeginSave(pb.BeginSaveRequest())
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (REASON_KEY, UNKNOWN_FINGERPRINT) in tuple(caught.value.trailing_metadata() or ())
        assert isinstance(coordinator_error(caught.value, "node 0"), errors.UnknownFingerprint)
        servicer.to_raise = errors.Precondition("another precondition")
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await pb_grpc.CheckpointStub(channel).BeginSave(pb.BeginSaveRequest())
        assert REASON_KEY not in dict(other.value.trailing_metadata() or ())
        assert isinstance(coordinator_error(other.value, "node 0"), errors.Aborted)

    serve(tmp_path, scenario)


def test_reason_of() -> None:
    class Typed(errors.Precondition):
        reason = "typed"

    assert reason_of(Typed("any wording")) == "typed"
    assert reason_of(errors.UnknownFingerprint("reworded")) == UNKNOWN_FINGERPRINT
    assert reason_of(errors.Precondition(str(errors.UnknownFingerprint()))) == ""  # the type carries it, not the text
    assert reason_of(ValueError("x")) == ""
    assert status_of(KeyError("x")) == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    ("metadata", "refused"),
    [
        ((), "wrong or missing peer token"),
        (((PEER_TOKEN_KEY, "wrong"),), "wrong or missing peer token"),
        (((PEER_TOKEN_KEY, TOKEN), (PEER_TOKEN_KEY, TOKEN)), "2 peer tokens in one call"),
        ((("other-key", TOKEN),), "wrong or missing peer token"),
        (((PEER_TOKEN_KEY, TOKEN),), ""),
    ],
)
def test_every_peer_call_needs_exactly_one_right_token_and_health_none(tmp_path: Path, metadata: tuple[tuple[str, str], ...], refused: str) -> None:
    async def scenario(channel: grpc.aio.Channel, servicer: Peer) -> None:
        stub = ppb_grpc.PeerStub(channel)
        check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        for call in (stub.Inventory(ppb.InventoryRequest(), metadata=metadata), _drain(stub.Fetch(ppb.FetchRequest(), metadata=metadata))):
            if refused:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert refused in (caught.value.details() or "") and TOKEN not in (caught.value.details() or "")
            else:
                try:
                    await call
                except grpc.aio.AioRpcError as exc:  # Fetch ends NOT_FOUND after its chunk: mapped too
                    assert exc.code() == grpc.StatusCode.NOT_FOUND and exc.details() == "gone after the first chunk"

    serve(tmp_path, scenario, peer=True)


async def _drain(call: Any) -> list[Any]:
    return [item async for item in call]


def test_check_token_refuses_an_empty_configured_token() -> None:
    with pytest.raises(errors.Unauthenticated):
        check_token([(PEER_TOKEN_KEY, "")], "")
    check_token([(PEER_TOKEN_KEY, "t")], "t")


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


@pytest.mark.parametrize(
    ("error", "expected", "message"),
    [
        (FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "x", ((REASON_KEY, UNKNOWN_FINGERPRINT),)), errors.UnknownFingerprint, "^x$"),
        (FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, str(errors.UnknownFingerprint())), errors.Aborted, "refused: unknown fingerprint"),
        # issue 30 finding 6: node 0's refusal of a run reaches the ranks of every node as itself
        (FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "job 'j' belongs to another run", ((REASON_KEY, RUN_REFUSED),)), errors.RunRefused, "^job 'j' belongs"),
        (FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), errors.InvalidRequest, "^bad$"),
        # issue 30 finding 11: what is wrong and what to do, not gRPC's words alone
        (FakeRpcError(grpc.StatusCode.UNAVAILABLE, ""), errors.Unavailable, r"the coordinator node 0 \(h:1\) is not reachable \(UNAVAILABLE\): .*start node 0's daemon, or check its address in --peers"),
        (FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "token"), errors.Unavailable, r"node 0 \(h:1\) refused this node's peer token \(token\): give every node the same --peer-token"),
        (FakeRpcError(grpc.StatusCode.ABORTED, "never joined"), errors.Aborted, "refused: never joined"),
    ],
)
def test_coordinator_error(error: FakeRpcError, expected: type[Exception], message: str) -> None:
    mapped = coordinator_error(error, "node 0 (h:1)")
    assert type(mapped) is expected
    with pytest.raises(expected, match=message):
        raise mapped
