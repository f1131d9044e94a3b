"""The checksums the index records of a stored tensor, computed from its bytes fed in order: the
xxh3-64 of all of them and the digests of its chunks (ckptd.common.chunks). The writer computes
them while it writes (write/writer.py), reuse while it checks a snapshot (write/reuse.py)."""

from __future__ import annotations

import xxhash

from ckptd.common.chunks import DIGEST_HEX, ChunkHasher, chunk_bytes_for


class TensorDigests:
    """The xxh3-64 and chunk digests of `nbytes` bytes fed to `update` in pieces of any size.

    A tensor of one chunk (every tensor of up to MIN_CHUNK_BYTES, most of a model's small ones)
    is hashed once: its one chunk's digest is the xxh3-64 of all its bytes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._whole = xxhash.xxh3_64()
        chunk_bytes = chunk_bytes_for(nbytes)
        self._chunks = ChunkHasher(chunk_bytes) if nbytes > chunk_bytes else None

    def update(self, data: memoryview) -> None:
        self._whole.update(data)
        if self._chunks is not None:
            self._chunks.update(data)

    def result(self) -> tuple[int, str]:
        """(xxh3-64 of all the bytes, the chunks' digests concatenated: "" for no bytes)."""
        digest = self._whole.intdigest()
        if self._chunks is not None:
            return digest, self._chunks.hexdigests()
        return digest, f"{digest:0{DIGEST_HEX}x}" if self.nbytes else ""
