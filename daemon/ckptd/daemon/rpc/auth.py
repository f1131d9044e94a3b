"""The peer token: daemons authenticate each other with a shared token in the call metadata.

`PeerTokenInterceptor` (on the Peer server, after `rpc_errors.ErrorStatusInterceptor`) checks
it on every call of the ckptd.v1.Peer service before its handler runs; health on the same port
needs no token. A refused call ends UNAUTHENTICATED, never naming the expected token.
"""

from __future__ import annotations

import hmac
from typing import Any, AsyncIterator, Sequence

import grpc

from ckptd.daemon import errors
from ckptd.daemon.rpc.errors import Behavior, RewrappingInterceptor

PEER_TOKEN_KEY = "ckptd-peer-token"
PEER_SERVICE = "/ckptd.v1.Peer/"


def check_token(metadata: Sequence[tuple[str, Any]] | None, token: str) -> None:
    """Raise Unauthenticated unless `metadata` carries exactly one peer token, the right one
    (compared in constant time); an empty `token` refuses every call."""
    given = [value for key, value in (metadata or ()) if key == PEER_TOKEN_KEY]
    presented = given[0] if len(given) == 1 and isinstance(given[0], str) else ""
    matches = hmac.compare_digest(presented.encode(), token.encode())
    if len(given) > 1:
        raise errors.Unauthenticated(f"{len(given)} peer tokens in one call: send exactly one ({PEER_TOKEN_KEY})")
    if not matches or not token:
        raise errors.Unauthenticated("wrong or missing peer token: every daemon needs the same --peer-token / CKPTD_PEER_TOKEN")


class PeerTokenInterceptor(RewrappingInterceptor):
    """Checks the peer token (check_token) before each ckptd.v1.Peer handler runs."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._token = token

    def applies_to(self, method: str) -> bool:
        return method.startswith(PEER_SERVICE)

    def wrap_unary(self, behavior: Behavior, name: str) -> Behavior:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            check_token(context.invocation_metadata(), self._token)
            return await behavior(request, context)

        return checked

    def wrap_stream(self, behavior: Behavior, name: str) -> Behavior:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            check_token(context.invocation_metadata(), self._token)
            answers = behavior(request, context)
            try:
                async for answer in answers:
                    yield answer
            finally:
                await answers.aclose()

        return checked
