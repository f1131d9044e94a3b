"""Wire code generated from protos/ (tools/gen_protos.py). Shared by the client and the daemon,
with the limits every channel and server of ckptd uses."""

MAX_MESSAGE_BYTES = 256 * 2**20  # a plan of hundreds of thousands of tensors, or a manifest of as many fragments
# A failed call's machine-readable reason travels in its trailing metadata under REASON_KEY, so
# that the caller acts on the reason, never on the wording of the message.
REASON_KEY = "ckptd-reason"
UNKNOWN_FINGERPRINT = "unknown-fingerprint"  # FAILED_PRECONDITION: resend the request with the tensor metadata
RUN_REFUSED = "run-refused"  # FAILED_PRECONDITION: another live run owns the job, or this run was superseded



def reason_of(exc: object) -> str:
    """The typed reason of a failed gRPC call (REASON_KEY in its trailing metadata), "" for none."""
    trailing = getattr(exc, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == REASON_KEY and isinstance(value, str):
            return value
    return ""


MESSAGE_SIZE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

# Every channel of ckptd (a rank to its daemon, a daemon to its peers): a restarted daemon is
# reachable again within a second, not after gRPC's default reconnect backoff of up to two
# minutes, during which every call fails at once ("connection refused") although it is back.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
