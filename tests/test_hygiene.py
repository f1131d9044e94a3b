"""Rules of the code base that a reviewer would otherwise have to check by hand."""

import ast
import contextlib
import os
import re
import sys
from arena_rig import take_arenas  # tests/arena_rig.py
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted((REPO / "client").rglob("*.py")) + sorted((REPO / "daemon").rglob("*.py"))
GENERATED = REPO / "client" / "ckptd" / "wire"


def test_nothing_is_ever_unpickled() -> None:
    banned = re.compile(r"\bimport pickle\b|\bpickle\.|torch\.save\(|\bmarshal\.|\bshelve\b")
    offenders = [str(p.relative_to(REPO)) for p in SOURCES if banned.search(p.read_text())]
    assert offenders == []
    # torch.load only as torch's restricted weights-only unpickler (`ckptd import` reads
    # torch.save files and DCP entries so): every call passes weights_only=True literally.
    unrestricted = [
        f"{p.relative_to(REPO)}:{node.lineno}"
        for p in SOURCES
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"
        and not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in node.keywords)
    ]
    assert unrestricted == []


def test_no_silently_swallowed_errors() -> None:
    bare = re.compile(r"except\s*:|except\s+(Base)?Exception\s*:\s*\n\s*pass\b")
    offenders = [str(p.relative_to(REPO)) for p in SOURCES if not p.is_relative_to(GENERATED) and bare.search(p.read_text())]
    assert offenders == []


def test_the_client_never_imports_the_daemon() -> None:
    client = [p for p in SOURCES if p.is_relative_to(REPO / "client")]
    offenders = [str(p.relative_to(REPO)) for p in client if "ckptd.daemon" in p.read_text()]
    assert offenders == []


def test_the_pure_core_does_no_io_and_no_rpc() -> None:
    pure = [REPO / f for f in (
        "daemon/ckptd/daemon/plan/save_plan.py", "client/ckptd/format/index.py", "client/ckptd/format/safetensors_header.py", "client/ckptd/common/boxes.py", "client/ckptd/common/reshard.py", "client/ckptd/common/tiling.py", "client/ckptd/common/quant.py", "client/ckptd/common/quant_options.py", "client/ckptd/common/codecs.py", "client/ckptd/common/blocks.py",
        "daemon/ckptd/daemon/plan/load_plan.py", "daemon/ckptd/daemon/plan/compression.py", "daemon/ckptd/daemon/plan/files.py", "client/ckptd/format/units.py", "client/ckptd/format/file_plan.py",
        "daemon/ckptd/daemon/plan/rollback.py", "daemon/ckptd/daemon/plan/node_files.py",
    )]
    banned = re.compile(r"^\s*(import|from)\s+(grpc|asyncio|os|shutil|pathlib)\b", re.M)
    assert [str(p.relative_to(REPO)) for p in pure if banned.search(p.read_text())] == []


MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def test_no_module_over_600_lines_and_no_class_over_400() -> None:
    """Small modules, one responsibility each (issue 21): a module or class past these limits
    does too much; split it by responsibility, not by line count."""
    too_long = []
    for path in SOURCES:
        if path.is_relative_to(GENERATED):
            continue
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(REPO)}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_the_engine_speaks_no_grpc() -> None:
    """The engine is wire-free: the servicers convert (rpc_convert) and map errors (rpc_errors)."""
    engine = sorted((REPO / "daemon" / "ckptd" / "daemon" / "engine").rglob("*.py"))
    banned = re.compile(r"^\s*(import|from)\s+(grpc|ckptd\.wire)\b", re.M)
    assert engine and [str(p.relative_to(REPO)) for p in engine if banned.search(p.read_text())] == []


# ------------------------------------------------------------------ the storage seam (issue 21 item 2)

DAEMON = REPO / "daemon" / "ckptd" / "daemon"
STORAGE = DAEMON / "storage"
BANNED_OS = {"open", "pwrite", "write", "replace", "rename", "renames", "unlink", "remove", "rmdir", "removedirs", "mkdir", "makedirs", "ftruncate", "sendfile", "truncate"}
BANNED_SHUTIL = {"rmtree", "move", "copy", "copy2", "copyfile", "copytree"}
BANNED_METHODS = {"write_bytes", "write_text", "unlink", "rename", "mkdir", "rmdir", "touch", "symlink_to", "hardlink_to"}

# (file under daemon/ckptd/daemon, enclosing function, call) -> why it is not I/O on the storage root.
# Entries marked TODO(lead) are root I/O that the engine split moves behind the backend.
ALLOWED = {
    ("handoff/arena.py", "Arena.__init__", "os.unlink"): "shared-memory arenas in /dev/shm, not the root",
    ("handoff/arena.py", "Arena.close", "os.unlink"): "shared-memory arenas in /dev/shm, not the root",
    ("handoff/arena.py", "Arena._punch", "os.open"): "shared-memory arenas in /dev/shm, not the root",
    ("handoff/arena.py", "remove_stale_arenas", ".unlink"): "shared-memory arenas in /dev/shm, not the root",
    ("app/cli.py", "main", "os.open"): "/dev/null for stdout at exit",
    ("engine/staging.py", "StagingFiles.open", "os.open"): "reopening a staging file in /dev/shm it created, not the root",
    ("engine/staging.py", "_unlink_if", ".unlink"): "staging files in /dev/shm, not the root",
    ("engine/staging.py", "StagingFiles.detach", "os.rename"): "a staging file in /dev/shm renamed before it is unlinked off the loop, not the root",
    ("app/server.py", "_prepare_socket", ".unlink"): "a stale socket, not the root",
    ("app/server.py", "serve", ".unlink"): "the socket, not the root",
    ("tools/export.py", "export_files", "shutil.rmtree"): "OUT, the operator's export directory, not the root",
    ("tools/export.py", "export_files", ".mkdir"): "OUT, the operator's export directory, not the root",
    ("tools/export.py", "export_files", "open(w)"): "OUT, the operator's export directory, not the root",
    ("tools/export.py", "export_files", ".write_bytes"): "OUT, the operator's export directory, not the root",
    ("tools/export.py", "export_files", ".rmdir"): "OUT, the operator's export directory, not the root",
    ("tools/export.py", "export_files", "os.replace"): "OUT, the operator's export directory, not the root",
    ("faults/files.py", "*", "*"): "test-only fault injection: wraps the os functions themselves",
    ("faults/objects.py", "*", "*"): "test-only fault injection of object-store requests: its event log, outside the root",
    ("engine/read_once.py", "ReadOnce.stage", "os.pwrite"): "a staging file in /dev/shm (load broadcast: blocks read once), not the root",
    ("rpc/peer_client.py", "PeerClient.fetch", "os.pwrite"): "a staging file in /dev/shm (a peer's Fetch into it), not the root",
    ("service.py", "CheckpointService.start", ".mkdir"): "the shm directory, not the root (Storage.clean_uncommitted makes the root)",
    ("tiers/bulk.py", "move_into_file", "os.pwrite"): "replica bytes into a file in /dev/shm (a replica or a staging file), not the root",
    ("tiers/replica_store.py", "ReplicaStore.check_and_rename", "os.rename"): "replica files in /dev/shm, not the root",
    ("tiers/replica_store.py", "open_ranges", "os.open"): "reading replica files in /dev/shm (O_RDONLY), not the root",
    ("tiers/replica_store.py", "remove_files", "os.unlink"): "replica files in /dev/shm, not the root",
}


def _banned_uses(path: Path) -> list[tuple[str, str, int]]:
    """(enclosing function, call, line) of each file-changing call or reference in `path`."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str, int]] = []

    def writes(mode: ast.expr | None) -> bool:
        return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(c in mode.value for c in "wax+")

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name):
                if (child.value.id == "os" and child.attr in BANNED_OS) or (child.value.id == "shutil" and child.attr in BANNED_SHUTIL):
                    found.append((scope, f"{child.value.id}.{child.attr}", child.lineno))
            if isinstance(child, ast.ImportFrom) and child.module in ("os", "shutil"):
                for alias in child.names:
                    if alias.name in BANNED_OS | BANNED_SHUTIL:
                        found.append((scope, f"from {child.module} import {alias.name}", child.lineno))
            if isinstance(child, ast.Call):
                func = child.func
                mode = child.args[1] if len(child.args) > 1 else next((k.value for k in child.keywords if k.arg == "mode"), None)
                if isinstance(func, ast.Name) and func.id == "open" and writes(mode):
                    found.append((scope, "open(w)", child.lineno))
                if isinstance(func, ast.Attribute):
                    if func.attr in BANNED_METHODS and not (isinstance(func.value, ast.Name) and func.value.id in ("os", "shutil")):
                        found.append((scope, f".{func.attr}", child.lineno))
                    if func.attr == "open" and not (isinstance(func.value, ast.Name) and func.value.id == "os"):
                        first = child.args[0] if child.args else next((k.value for k in child.keywords if k.arg == "mode"), None)
                        if writes(first):
                            found.append((scope, ".open(w)", child.lineno))
                    if func.attr == "fdopen" and writes(mode):
                        found.append((scope, "os.fdopen(w)", child.lineno))
            visit(child, inner)

    visit(tree, "")
    return found


def test_only_the_storage_package_changes_files_static() -> None:
    """An AST scan of the daemon outside ckptd.daemon.storage: no call that opens for writing,
    writes, renames or deletes a file, except the ALLOWED ones (each with its reason)."""
    offenders, used = [], set()
    for path in sorted(DAEMON.rglob("*.py")):
        if path.is_relative_to(STORAGE):
            continue
        rel = str(path.relative_to(DAEMON))
        for scope, call, line in _banned_uses(path):
            for key in ((rel, scope, call), (rel, "*", "*")):
                if key in ALLOWED:
                    used.add(key)
                    break
            else:
                offenders.append(f"{rel}:{line} {scope or '<module>'}: {call}")
    assert offenders == [], "file I/O outside ckptd.daemon.storage (go through the StorageBackend, or add an ALLOWED entry with its reason)"
    assert sorted(set(ALLOWED) - used) == [], "ALLOWED entries that match nothing any more: remove them"


# ---- dynamic: an audit hook during a save, a load, verify, export and housekeeping

_AUDITED = {"open", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir"}


class _Recorder:
    """The process's audit hook (sys.addaudithook cannot be removed): does nothing unless
    `root` is set, then records (event, path, module of the first ckptd frame)."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, event: str, args: tuple) -> None:
        if self.root is None or event not in _AUDITED or not args:
            return
        paths = [a for a in args[:2 if event in ("os.rename", "os.replace") else 1] if isinstance(a, (str, bytes, os.PathLike))]
        for p in paths:
            text = os.fsdecode(os.fspath(p))
            # relative names are relative to a directory descriptor (dir_fd): counted as under the root
            if os.path.isabs(text) and not (text == self.root or text.startswith(self.root + os.sep)):
                continue
            frame = sys._getframe(1)
            module = "?"
            while frame is not None:
                name = frame.f_globals.get("__name__", "")
                if name.startswith("ckptd."):
                    module = name
                    break
                frame = frame.f_back
            self.events.append((event, text, module))


_RECORDER: list[_Recorder] = []  # the one hook of this process, installed on first use


@contextlib.contextmanager
def _audited(root: Path) -> Iterator[_Recorder]:
    if not _RECORDER:
        _RECORDER.append(_Recorder())
        sys.addaudithook(_RECORDER[0])
    recorder = _RECORDER[0]
    recorder.events = []
    recorder.root = str(root.resolve())
    try:
        yield recorder
    finally:
        recorder.root = None


def test_only_the_storage_package_touches_the_root_at_run_time(tmp_path: Path) -> None:
    """Every open, rename, remove, rmdir and mkdir under the root during a save (twice, the second
    on recycled files), a commit by StepCommit, reads of the index and of every fragment,
    verify, export (to a directory outside the root), retention and gc comes from a frame of
    ckptd.daemon.storage."""
    import tempfile

    import numpy as np
    import torch

    from ckptd.common.boxes import Box
    from ckptd.daemon.handoff.arena import ArenaPool
    from ckptd.daemon.tools.export import export_model
    from ckptd.daemon.tools.inspect import read_step
    from ckptd.daemon.plan.save_plan import TensorSpec, make_save_plan
    from ckptd.daemon.storage import Storage
    from ckptd.daemon.tools.verify import verify_step
    from ckptd.daemon.write.request import PersistRequest, Progress
    from ckptd.daemon.write.writer import persist

    tensors = {"model/w": torch.randn(64, 32), "model/b": torch.randn(32), "optimizer/state/w/exp_avg": torch.randn(64, 32)}
    plan = make_save_plan([[TensorSpec(n, n.split("/")[0], "F32", tuple(t.shape), Box.full(tuple(t.shape))) for n, t in tensors.items()]])
    root = tmp_path / "root"
    with tempfile.TemporaryDirectory(prefix="ckptd-test-", dir="/dev/shm") as shm:
        pool = ArenaPool(Path(shm), "job", max_inflight=1)
        arenas = take_arenas(pool, plan.arena_bytes)
        for slot in plan.slots:
            view = arenas.arenas[slot.rank].view(slot.offset, slot.nbytes)
            np.frombuffer(view, dtype=np.uint8)[:] = tensors[slot.name].contiguous().reshape(-1).view(torch.uint8).numpy()
            view.release()
        with _audited(root) as recorder:
            storage = Storage(root)
            storage.writing.ensure_step("job", 0)  # makes the root
            for step in (1, 2, 3):
                persist(storage, PersistRequest("job", step, plan, arenas, {0: {}}, {"config.json": b"{}"}, None, 2**30, 2), Progress(plan.total_bytes))
            storage.janitor.remove_step("job", 1, recycle=True)
            persist(storage, PersistRequest("job", 4, plan, arenas, {}, {}, None, 2**30, 2), Progress(plan.total_bytes))
            index = storage.files.read_index("job", 4)
            for t in index.tensors:
                for f in t.fragments:
                    assert len(storage.files.read_range("job", 4, f.file, f.offset, f.nbytes)) == f.nbytes
            assert verify_step(storage.tree.step_dir("job", 4)).ok
            assert read_step(storage.tree.step_dir("job", 4)).step == 4
            export_model(storage.tree.step_dir("job", 4), tmp_path / "exported")
            storage.writing.ensure_step("job", 5)
            storage.janitor.mark_prepared("job", 5, "s", 0)
            storage.janitor.unmark_prepared("job", 5)
            storage.janitor.leftovers("job", set())
            storage.janitor.clean_uncommitted()
            storage.catalog.root_id()
        pool.close()
    outside = sorted({(event, module) for event, _, module in recorder.events if not module.startswith("ckptd.daemon.storage.")})
    assert outside == [], recorder.events
    assert {event for event, _, _ in recorder.events} >= {"open", "os.rename", "os.mkdir", "os.remove", "os.rmdir"}  # os.replace audits as os.rename


def test_the_license_file_is_the_license_pyproject_declares() -> None:
    """Issue 22 item 8: a LICENSE file matching pyproject (Apache-2.0)."""
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]["text"]
    text = (REPO / "LICENSE").read_text()
    assert declared == "Apache-2.0" and text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text


# ------------------------------------------------------------------ the import graph (issue 32)

def _graph():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "tools"))
    import arch_metrics

    return arch_metrics, arch_metrics.module_graph(REPO)


def test_every_import_points_down_the_layers() -> None:
    """tests/layers.py declares the layers top to bottom, the daemon's above the client root's; a
    module imports only its own layer or those below (imports under TYPE_CHECKING count: a reader
    and mypy follow them too)."""
    from layers import DAEMON_LAYERS, LAYERS

    metrics, graph = _graph()
    unplaced = sorted(m for m in graph.paths if metrics.layer_of(m, DAEMON_LAYERS + LAYERS) is None and m != "ckptd.daemon")
    assert unplaced == [], "modules in no layer: add them to tests/layers.py"
    upward = set(metrics.upward_imports(graph, [*DAEMON_LAYERS, *LAYERS]))  # the daemon stands on the client root
    assert sorted(upward) == [], "imports that point up the layers (tests/layers.py): invert the dependency or move the module"


def test_no_import_circles_counting_type_checking() -> None:
    metrics, graph = _graph()
    found = metrics.circles(graph.edges(with_type_only=True))
    assert found == [], "import circles (each a set of modules that import each other): point the imports one way"


def test_no_module_imports_another_packages_private_module() -> None:
    """`ckptd.a._b` is private to package `ckptd.a`: only `ckptd.a` itself and its modules (and below) import it."""
    _, graph = _graph()
    offenders = []
    for module in graph.paths:
        for target in graph.edges(with_type_only=True)[module]:
            parts = target.split(".")
            private = next((i for i, p in enumerate(parts) if p.startswith("_") and p != "__init__"), None)
            owner = ".".join(parts[:private])  # the package whose private module it is: it and its modules may import it
            if private is not None and module != owner and not module.startswith(owner + "."):
                offenders.append(f"{module} -> {target}")
    assert sorted(offenders) == [], "a private module imported from another package: make what it needs public"


def test_the_engine_is_wire_free_through_everything_it_imports() -> None:
    """Not only the engine's own modules: nothing the engine imports, directly or not, imports
    grpc or the generated stubs (the servicers and the peer client convert; `ckptd.wire` itself
    holds plain constants, such as the error reasons the domain errors carry)."""
    metrics, graph = _graph()
    edges = graph.edges(with_type_only=True)
    seen: set[str] = set()
    todo = [m for m in graph.paths if m.startswith("ckptd.daemon.engine.")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges[m])
    wire = re.compile(r"^\s*(import|from)\s+(grpc|ckptd\.wire\.v1)\b", re.M)
    reached = sorted(m for m in seen if wire.search(graph.paths[m].read_text()))
    assert reached == [], "engine modules reach grpc or the wire stubs through these"
