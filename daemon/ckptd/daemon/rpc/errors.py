"""Domain errors <-> gRPC status codes, in one place for both servers and the peer client.

Server side: `ErrorStatusInterceptor` is registered on the Checkpoint server (Unix socket) and
on the Peer server (TCP). Every handler of either server runs inside it, so a servicer method
only raises domain errors (`errors.py`) and a new RPC cannot forget its mapping: the table
`STATUS` gives the code, the message is the error's text, and anything unexpected is
INTERNAL, logged with its traceback (the daemon stays up).

Typed signals: an error that carries a `reason` (see `reason_of`) also sends it in the trailing
metadata under `REASON_KEY`, so a caller acts on the reason, not on the wording of the message.

Client side (this daemon calling a peer): `coordinator_error` turns a failed call to node 0
into the domain error the engine expects; `coordinator_unreachable` is the one wording of "node 0
cannot be reached" (also for a save that times out joining there, engine/coordinator.py).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from ckptd.common import dtypes
from ckptd.common.names import InvalidNameError
from ckptd.daemon import errors
from ckptd.wire import REASON_KEY, RUN_REFUSED, UNKNOWN_FINGERPRINT
from ckptd.wire import reason_of as wire_reason_of

log = logging.getLogger(__name__)

STATUS: dict[type[errors.CkptdError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Precondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Timeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
Wrap = Callable[[Behavior, str], Behavior]


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code of `exc`: its nearest class in STATUS; bad names and dtypes are
    INVALID_ARGUMENT; anything else INTERNAL."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    if isinstance(exc, (InvalidNameError, dtypes.UnknownDtypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def reason_of(exc: BaseException) -> str:
    """The typed reason of `exc` ("" for none): its `reason` attribute when it has one."""
    reason = getattr(exc, "reason", "")
    return reason if isinstance(reason, str) else ""


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception, where: str) -> None:
    """End the call with the status of `exc` (raises grpc.aio.AbortError, as context.abort does).
    where: the RPC's name, for the log and the INTERNAL message."""
    code = status_of(exc)
    message = str(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", where)
        message = f"internal error in {where}: {type(exc).__name__}: {exc}"
    message = errors.bounded(message)  # a longer one would reach the caller as a transport error instead
    reason = reason_of(exc)
    if reason:
        await context.abort(code, message, ((REASON_KEY, reason),))
    await context.abort(code, message)


def rpc_name(method: str) -> str:
    """"/ckptd.v1.Checkpoint/BeginSave" -> "BeginSave"."""
    return method.rsplit("/", 1)[-1]


def rewrap(handler: grpc.RpcMethodHandler, unary: Wrap, stream: Wrap, name: str) -> grpc.RpcMethodHandler:
    """`handler` with its behavior replaced by `unary(behavior, name)` when it is a coroutine
    function (one answer, or a stream written with context.write) or `stream(behavior, name)`
    when it streams its answer from an async generator. A handler that is not
    async (none in ckptd) is returned as it is."""
    for kind, build in (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    ):
        behavior = getattr(handler, kind)
        if behavior is None:
            continue
        if inspect.isasyncgenfunction(behavior):
            new = stream(behavior, name)
        elif inspect.iscoroutinefunction(behavior):
            new = unary(behavior, name)
        else:
            return handler
        return build(new, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    return handler


class RewrappingInterceptor(grpc.aio.ServerInterceptor):
    """Base of the daemon's server interceptors: each method's handler wrapped once (by
    `wrap_unary` / `wrap_stream`) and reused, since the wrappers hold no per-call state."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def applies_to(self, method: str) -> bool:
        """Whether `method` ("/package.Service/Name") is wrapped; all by default."""
        return True

    def wrap_unary(self, behavior: Behavior, name: str) -> Behavior:
        raise NotImplementedError

    def wrap_stream(self, behavior: Behavior, name: str) -> Behavior:
        raise NotImplementedError

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self.applies_to(method):
            return handler
        cached = self._cache.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = rewrap(handler, self.wrap_unary, self.wrap_stream, rpc_name(method))
        self._cache[method] = (handler, wrapped)
        return wrapped


class ErrorStatusInterceptor(RewrappingInterceptor):
    """Maps what a handler raises to its status (abort_with); a status the handler set itself
    (context.abort) passes unchanged. Register it first, so it also maps what later interceptors
    raise (the peer token check)."""

    def wrap_unary(self, behavior: Behavior, name: str) -> Behavior:
        async def mapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc, name)
            raise AssertionError("unreachable: context.abort raises")

        return mapped

    def wrap_stream(self, behavior: Behavior, name: str) -> Behavior:
        async def mapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            answers = behavior(request, context)
            try:
                async for answer in answers:
                    yield answer
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc, name)
            finally:
                await answers.aclose()  # the handler's own cleanup (e.g. Fetch closes its file) runs now

        return mapped


def coordinator_unreachable(coordinator: str, detail: str) -> str:
    """Why a node cannot save: the coordinator (node 0, described by `coordinator`, e.g. "node 0
    (10.0.0.1:7000)") cannot be reached; detail: what was seen (gRPC's reason, a wait)."""
    return (
        f"the coordinator {coordinator} is not reachable ({detail}): every save of a job on several nodes "
        "goes through node 0; start node 0's daemon, or check its address in --peers on every node"
    )


def coordinator_error(exc: grpc.RpcError, coordinator: str) -> errors.CkptdError:
    """The domain error for a failed call to the coordinator (node 0, described by
    `coordinator`): Precondition when it asks for the tensor metadata again (REASON_KEY), so the
    caller resends it; RunRefused when the run may not save into the job (its message is node 0's,
    for the ranks); InvalidRequest for what it refused as invalid; Unavailable when it cannot be
    reached (`coordinator_unreachable`) or does not accept our token; Aborted for anything else."""
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.FAILED_PRECONDITION and wire_reason_of(exc) == UNKNOWN_FINGERPRINT:
        return errors.UnknownFingerprint(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION and wire_reason_of(exc) == RUN_REFUSED:
        return errors.RunRefused(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidRequest(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.Unavailable(coordinator_unreachable(coordinator, details))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.Unavailable(
            f"the coordinator {coordinator} refused this node's peer token ({details}): give every node the same "
            "--peer-token (CKPTD_PEER_TOKEN)"
        )
    return errors.Aborted(f"the coordinator {coordinator} refused: {details}")

