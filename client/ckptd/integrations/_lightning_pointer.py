"""Pointer files: what CkptdCheckpointIO leaves at the paths PyTorch Lightning chooses.

Lightning addresses checkpoints by path (ModelCheckpoint's `dirpath/epoch=0-step=10.ckpt`,
`last.ckpt`); ckptd by (job, step). A pointer is a small JSON file at Lightning's path, in
Lightning's directory (not in ckptd's storage root), that names the job and step:

    {"format": "ckptd-lightning-pointer", "version": 1, "job": "run-42", "step": 10}

A pointer of a save that repeated a step already saved under another path (ModelCheckpoint's
last.ckpt right after the top-k file of the same global_step) also carries "shape": that save's
key order and the encoded JSON of the parts that differ from the step's (see
_lightning_state.SameStep.own_shape), because Lightning's bookkeeping differs between the two
files (ModelCheckpoint's last_model_path) while their tensors are the same; and "tensors":
Lightning's own small tensors of that save that the step lacks or holds other values of (a
second ModelCheckpoint's best_model_score at the step; at most 1 MiB, base64 of their bytes).

A pointer is written once its step is durable (committed by ckptd), atomically: a temporary
file in the same directory, fsynced, renamed over the path, then the directory fsynced. So a
pointer that exists names a committed step, and a crash leaves the previous pointer whole (a
killed run's last.ckpt names the newest step that was durable, never a half-written one).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ckptd.common import json_read
from ckptd.common.names import InvalidNameError, check_job_id

log = logging.getLogger("ckptd.integrations.lightning")

FORMAT = "ckptd-lightning-pointer"
VERSION = 1
# A pointer is a few hundred bytes, a few hundred KB with a shape of a large model's state_dict
# names; anything larger is not a pointer, and is not read whole to find out.
MAX_POINTER_BYTES = 64 * 2**20
_SHAPE_KEYS = frozenset({"order", "trees", "state_dict_metadata"})


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the checkpoint is `step` of ckptd job `job`; `shape` (or None)
    is this save's key order and the parts of its non-tensor content that differ from the step's."""

    job: str
    step: int
    shape: dict[str, Any] | None = None

    def to_json(self) -> str:
        body: dict[str, Any] = {"format": FORMAT, "version": VERSION, "job": self.job, "step": self.step}
        if self.shape is not None:
            body["shape"] = self.shape
        return json.dumps(body, allow_nan=False, separators=(",", ":"))


def local_path(path: Any) -> str:
    """`path` (str or os.PathLike) as a local file system path.

    Raises ValueError for a URL (s3://..., gs://...): pointers are local files.
    """
    raw: str | bytes = os.fspath(path)
    text = os.fsdecode(raw)
    if "://" in text:
        raise ValueError(
            f"{text!r} is a URL; CkptdCheckpointIO keeps its pointer files in a local directory (ckptd stores the "
            "checkpoint itself): give ModelCheckpoint a local dirpath"
        )
    return text


def _not_a_pointer(path: str, why: str) -> ValueError:
    return ValueError(f"not a ckptd checkpoint pointer: {path}: {why}")


def read_pointer(path: str) -> Pointer:
    """The pointer at `path`.

    Raises FileNotFoundError when there is no file, ValueError ("not a ckptd checkpoint
    pointer: ...") saying what the file is instead (a torch.save archive, a directory, other
    JSON) and what to do.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POINTER_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint file not found: {path}") from None
    except IsADirectoryError:
        raise _not_a_pointer(path, "it is a directory (a sharded or distributed checkpoint?); CkptdCheckpointIO writes one file per checkpoint") from None
    if data.startswith(b"PK\x03\x04") or data.startswith(b"\x80"):
        raise _not_a_pointer(
            path,
            "it is a checkpoint file that torch's serialization wrote (the default TorchCheckpointIO's format); "
            "load it with a Trainer without CkptdCheckpointIO, or import it into ckptd with `ckptd import`",
        )
    if len(data) > MAX_POINTER_BYTES:
        raise _not_a_pointer(path, f"it is larger than {MAX_POINTER_BYTES} bytes; a pointer is a small JSON file")
    try:
        body = json_read.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _not_a_pointer(path, f"it is not JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise _not_a_pointer(path, f"it is JSON without \"format\": \"{FORMAT}\"")
    if body.get("version") != VERSION:
        raise _not_a_pointer(path, f"version {body.get('version')!r}; this ckptd reads version {VERSION} (was it written by a newer ckptd?)")
    job, step, shape = body.get("job"), body.get("step"), body.get("shape")
    try:
        if not isinstance(job, str):
            raise InvalidNameError(f"{job!r} is not a string")
        check_job_id(job)
    except InvalidNameError as exc:
        raise _not_a_pointer(path, f"its job is bad: {exc}") from None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _not_a_pointer(path, f"its step is {step!r}, not an integer >= 0")
    if shape is not None and not (
        isinstance(shape, dict) and set(shape) - {"tensors"} == _SHAPE_KEYS and isinstance(shape["trees"], dict)
        and isinstance(shape.get("tensors", {}), dict)
    ):
        raise _not_a_pointer(path, "its \"shape\" is not one CkptdCheckpointIO writes")
    return Pointer(job, step, shape)


def write_pointer(path: str, pointer: Pointer, publish: Callable[[Callable[[], None]], bool]) -> bool:
    """Write `pointer` at `path` atomically; returns whether it was written.

    The bytes go to a temporary file beside `path` (the directory is made if needed) and are
    fsynced; then publish(rename) is called, which calls rename (or does not, when the pointer
    is no longer wanted) under the caller's lock and returns whether it did; the directory is
    fsynced after a rename, the temporary file removed otherwise.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.ckptd-tmp-{os.getpid()}-{threading.get_ident()}")
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(pointer.to_json())
        f.flush()
        os.fsync(f.fileno())
    if not publish(lambda: os.replace(temporary, path)):
        os.remove(temporary)
        return False
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def restore_missing_pointer(job: str, step: int, saved: str | None, target: str, callbacks: Any) -> bool:
    """Write the pointer of step `step` at `saved`, the file it was saved to, when that is
    missing (the run stopped after the save was durable and before its pointer was written),
    lies beside `target` (the pointer just loaded) and the loaded ModelCheckpoint states
    (`callbacks`: the checkpoint's) name it as their best, top-k or last file: else the resumed
    run's best_model_path names a file that never appears. Returns whether it was written."""
    if saved is None or os.path.lexists(saved) or os.path.dirname(saved) != os.path.dirname(os.path.abspath(target)):
        return False
    if not isinstance(callbacks, dict) or not any(saved in _named_files(state) for state in callbacks.values()):
        return False

    def publish(rename: Callable[[], None]) -> bool:
        rename()
        return True

    written = write_pointer(saved, Pointer(job, step), publish)
    log.warning("%s (step %s of ckptd job %r) had no pointer: the run stopped before writing it; written now", saved, step, job)
    return written


def _named_files(state: Any) -> set[str]:
    """The files a ModelCheckpoint's saved state names (best, k-th best, top-k, last)."""
    if not isinstance(state, dict):
        return set()
    named = {state.get(key) for key in ("best_model_path", "kth_best_model_path", "last_model_path")}
    named.update(state.get("best_k_models") or ())
    return {os.path.abspath(p) for p in named if isinstance(p, str) and p}


class PointerWriter:
    """Writes pointers in the background, each once its save is durable, in the order of the saves.

    submit() returns at once; a helper thread waits until the save is durable and writes the
    pointer. cancel(path) (Lightning removed the checkpoint) withdraws every pointer to `path`
    not yet written; a later save to the same path is wanted again. flush() waits for every
    submitted pointer. Failures are logged, and the first is kept for take_error().
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._wanted: dict[str, set[int]] = {}  # path -> tokens of pointers submitted and not withdrawn
        self._futures: list[Future[None]] = []
        self._token = 0
        self._error: BaseException | None = None

    def submit(self, path: str, pointer: Pointer, durable: Callable[[], bool]) -> None:
        """Write `pointer` at `path` once durable() (which blocks until the save is committed)
        returns True; not at all when it returns False or raises."""
        with self._lock:
            self._token += 1
            token = self._token
            self._wanted.setdefault(path, set()).add(token)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-lightning-pointer")
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self._pool.submit(self._write, path, pointer, durable, token))

    def take_error(self) -> BaseException | None:
        """The first failure since the last call (a save that did not become durable with
        on_error="raise", a pointer that could not be written), or None."""
        with self._lock:
            error, self._error = self._error, None
        return error

    def cancel(self, path: str) -> None:
        """Withdraw every pointer to `path` that is not written yet."""
        with self._lock:
            self._wanted.pop(path, None)

    def flush(self) -> None:
        """Wait until every submitted pointer is written, withdrawn or failed."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        """flush(), then stop the helper thread (a later submit starts a new one)."""
        self.flush()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _write(self, path: str, pointer: Pointer, durable: Callable[[], bool], token: int) -> None:
        try:
            if not durable():
                log.warning("checkpoint %s (step %s of job %r) is not durable: its pointer file is not written", path, pointer.step, pointer.job)
                self._withdraw(path, token)
                return
            write_pointer(path, pointer, lambda rename: self._publish(path, token, rename))
        except Exception as exc:  # kept for the caller; the thread serves the next pointer
            log.error("checkpoint %s (step %s of job %r): its pointer file is not written: %s", path, pointer.step, pointer.job, exc)
            self._withdraw(path, token)
            with self._lock:
                if self._error is None:
                    self._error = exc

    def _publish(self, path: str, token: int, rename: Callable[[], None]) -> bool:
        with self._lock:
            tokens = self._wanted.get(path)
            if tokens is None or token not in tokens:
                return False  # Lightning removed this checkpoint meanwhile
            rename()
            tokens.discard(token)
            if not tokens:
                del self._wanted[path]
            return True

    def _withdraw(self, path: str, token: int) -> None:
        with self._lock:
            tokens = self._wanted.get(path)
            if tokens is not None:
                tokens.discard(token)
                if not tokens:
                    del self._wanted[path]
