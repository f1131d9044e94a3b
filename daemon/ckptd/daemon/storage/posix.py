"""The POSIX StorageBackend: a directory tree `<root>/<job>/step-XXXXXXXX/...` with
`<root>/<job>/latest` and `<root>/<job>/.recycle/`.

`Storage` composes the four roles of base.py, each a class of its own over the root's paths
(posix_tree.PosixTree): posix_catalog.PosixCatalog, posix_files.PosixFiles,
posix_writing.PosixWriting and posix_janitor.PosixJanitor; and the node claim of the root
(root_lock.NodeClaim). Nothing is followed through a link or written over what the daemon did
not make (fs.ForeignEntry).
"""

from __future__ import annotations

from pathlib import Path

from ckptd.daemon.storage.posix_catalog import PosixCatalog
from ckptd.daemon.storage.posix_files import PosixFiles
from ckptd.daemon.storage.posix_janitor import PosixJanitor
from ckptd.daemon.storage.posix_tree import PosixTree
from ckptd.daemon.storage.posix_writing import PosixWriting
from ckptd.daemon.storage.root_lock import NodeClaim


class Storage:
    """The root directory: `<root>/<job>/step-XXXXXXXX/...` and `<root>/<job>/latest`."""

    def __init__(self, root: Path) -> None:
        self.tree = PosixTree(root)
        self._claim = NodeClaim(self.tree.root)  # this daemon's node lock of the root (root_lock.py)
        self.catalog = PosixCatalog(self.tree)
        self.files = PosixFiles(self.tree)
        self.writing = PosixWriting(self.tree)
        self.janitor = PosixJanitor(self.tree, self.catalog, self.writing, self._claim)

    @property
    def root(self) -> Path:
        return self.tree.root

    @property
    def location(self) -> str:
        return str(self.tree.root)

    def claim(self, node: int, socket: str) -> None:
        self._claim.take(node, socket)

    def release(self) -> None:
        self._claim.release()
