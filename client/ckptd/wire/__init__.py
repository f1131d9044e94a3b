"""Wire code generated from protos/ (tools/gen_protos.py). Shared by the client and the daemon,
with the limits every channel and server of ckptd uses."""

MAX_MESSAGE_BYTES = 256 * 2**20  # a plan of hundreds of thousands of tensors, or a manifest of as many fragments
MESSAGE_SIZE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
