"""What the client and the daemon share. Nothing here imports grpc or does work at import.

Pure (no torch, no file system, no environment): boxes, tiling, reshard, chunks, blocks, codecs,
quant_options, frames, dtypes, names, retention, sizes. Not pure, and imported only where
needed: quant (the codecs' torch math; the native encoder at the first encode), cudart (the CUDA
runtime through ctypes, loaded at first use), paths (the daemon's address and directories,
from the environment) and files (lstat checks and reads that never follow a link).
"""
