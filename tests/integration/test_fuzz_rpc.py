"""Property-based fuzzing of every RPC of both gRPC services (issue 20).

Hypothesis generates requests — valid-looking ones and hostile ones: empty, huge and negative
numbers, NaN and infinities, path traversal, absolute paths, NUL bytes, unicode, very long names,
huge repeated fields, wrong enum values, and fields that do not fit together (a commit for a save
never begun, an unknown layout or plan, a file that is not part of a step) — and sends them over
real sockets to real daemons: ckptd.v1.Checkpoint on a single daemon's Unix socket, ckptd.v1.Peer
on the TCP port of the coordinator (node 0) and of node 1 of a two-node cluster, with the right
peer token (so the requests reach the handlers) and a few times without it.

Properties: no request gets INTERNAL or UNKNOWN (a status that says what was wrong, or OK); the
daemons log no traceback; they stay up (health, then a normal save and load); nothing is written
outside their roots (a canary directory and a snapshot of the test's directory are compared) and
nothing outside a step is served by Fetch.

CKPTD_FUZZ_EXAMPLES sets the examples per test of the default run (50); `pytest -m long` runs each
test with 150 (the tests' [150] variants). The run is derandomized: CI sees the
same requests every time (CKPTD_FUZZ_RANDOM=1: new ones each run, to hunt). The number of requests
sent per RPC is printed at the end. The deep-JSON cases the fuzzer found have their own tests.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.client import CheckpointClient
from ckptd.common.names import JOB_ID_PATTERN, KINDS
from ckptd.demo.process import DaemonProcess
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc
from daemon_rig import metadata_digest

EXAMPLES = int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "50"))
LONG_EXAMPLES = 150
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("CKPTD_FUZZ_RANDOM"),  # set: other requests each run (a hunt, not CI)
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
TOKEN = "fuzz-peer-token-0123456789abcdef"
TOKEN_KEY = "ckptd-peer-token"
BAD = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
CALL_TIMEOUT_S = 5.0  # a request that waits (other ranks, a free arena) ends with DEADLINE_EXCEEDED: fine
ESCAPE = Path("/tmp/ckptd-fuzz-escape")  # an absolute path the requests name; it must never appear
INT64 = (-(2**63), 2**63 - 1)
INT32 = (-(2**31), 2**31 - 1)

# ------------------------------------------------------------------ the daemons


@dataclass
class Place:
    """A daemon under fuzz, the directory around its root, and what must stay as it is."""

    daemon: DaemonProcess
    base: Path  # the test's directory: holds the root, the canary and the daemon's log
    canary: Path
    secret: bytes
    step_files: list[str]  # files of the committed step "real"/1
    before: dict[str, tuple[int, int]] = field(default_factory=dict)

    def outside_root(self) -> dict[str, tuple[int, int]]:
        """(size, mtime_ns) of every file and directory under `base` except the root and the logs."""
        seen = {}
        for dirpath, dirnames, filenames in os.walk(self.base):
            here = Path(dirpath)
            if here == self.base:  # the daemons' roots: root (one daemon), root-0 and root-1 (a cluster)
                dirnames[:] = [d for d in dirnames if not d.startswith("root")]
            for name in [*dirnames, *filenames]:
                path = here / name
                if path.suffix == ".log":
                    continue
                info = path.lstat()
                seen[str(path.relative_to(self.base))] = (info.st_size, 0 if path.is_dir() else info.st_mtime_ns)
        return seen


def _plant_canary(base: Path) -> tuple[Path, bytes]:
    canary = base / "canary"
    canary.mkdir()
    secret = b"canary-secret-" + os.urandom(8).hex().encode()
    (canary / "secret").write_bytes(secret)
    (canary / "step-00000001").mkdir()
    return canary, secret


def _real_save(address: str, job: str, local_world_size: int | None = None) -> None:
    """A normal one-rank save of step 1 and a load of it (the daemon works before and after the fuzz)."""
    state = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}, "extra": {"epoch": 3}}
    with CheckpointClient(job, address=address, rank=0, world_size=1, local_world_size=local_world_size, on_error="raise", timeout_s=30) as ckpt:
        ckpt.save(1, state).wait_durable(60)
        restored = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": {"epoch": 0}}
        assert ckpt.load(restored, step=1) == 1
    assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())
    assert restored["extra"]["epoch"] == 3


def _healthy(address: str, *, channel_credentials: grpc.ChannelCredentials | None = None) -> bool:
    channel = grpc.secure_channel(address, channel_credentials) if channel_credentials else grpc.insecure_channel(address)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module", params=[EXAMPLES, pytest.param(LONG_EXAMPLES, marks=pytest.mark.long)])
def fuzz(request: pytest.FixtureRequest) -> settings:
    """The hypothesis settings of a fuzz test: FUZZ with the examples of the run (default or long)."""
    return settings(FUZZ, max_examples=request.param)


@pytest.fixture(scope="module")
def counts(request: pytest.FixtureRequest) -> Iterator[collections.Counter[str]]:
    """Requests sent per RPC; printed at the end of the module (also without -s)."""
    counter: collections.Counter[str] = collections.Counter()
    yield counter
    lines = [f"  {rpc}: {n}" for rpc, n in sorted(counter.items())]
    summary = "\nfuzz requests per RPC (total %d):\n%s" % (sum(counter.values()), "\n".join(lines))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(summary)
    else:
        print(summary)


@pytest.fixture(scope="module")
def single(module_daemons) -> Iterator[Place]:
    """A single-node daemon with one committed step (job "real"), under fuzz for the module."""
    base = module_daemons.root.parent
    canary, secret = _plant_canary(base)
    daemon = module_daemons.start("--save-timeout", "2")
    _real_save(daemon.address, "real")
    step_dir = module_daemons.root / "real" / "step-00000001"
    place = Place(daemon, base, canary, secret, sorted(p.name for p in step_dir.iterdir()))
    place.before = place.outside_root()
    yield place
    assert daemon.popen.poll() is None, f"the daemon died during the fuzz run:\n{daemon.log_text()[-4000:]}"
    assert _healthy(daemon.address)
    _real_save(daemon.address, "after-fuzz")
    _check_nothing_escaped(place)


@pytest.fixture(scope="module")
def cluster(module_node_sets) -> Iterator[tuple[list[str], list[Place]]]:
    """Two daemons with node-local roots and one committed step on node 0 (job "real")."""
    nodes = module_node_sets(2, shared_root=False)
    canary, secret = _plant_canary(nodes.base)
    for node in (0, 1):
        nodes.start(node, "--save-timeout", "2", "--peer-token", TOKEN)
    _real_save(nodes.address(0), "real", local_world_size=1)
    step_dir = nodes.root(0) / "real" / "step-00000001"
    files = sorted(p.name for p in step_dir.iterdir())
    places = [Place(nodes.running[n], nodes.base, canary, secret, files) for n in (0, 1)]
    for place in places:
        place.before = place.outside_root()
    with grpc.insecure_channel(nodes.peers[0]) as channel:  # the token is the one the daemons use
        reply = ppb_grpc.PeerStub(channel).Inventory(ppb.InventoryRequest(job="real", step=1), metadata=((TOKEN_KEY, TOKEN),), timeout=10)
    assert reply.committed
    yield nodes.peers, places
    for place in places:
        daemon = place.daemon
        assert daemon.popen.poll() is None, f"a daemon died during the fuzz run:\n{daemon.log_text()[-4000:]}"
        assert _healthy(daemon.address)
    _real_save(nodes.address(0), "after-fuzz", local_world_size=1)
    for place in places:
        _check_nothing_escaped(place)


def _check_nothing_escaped(place: Place) -> None:
    assert (place.canary / "secret").read_bytes() == place.secret
    assert sorted(p.name for p in place.canary.iterdir()) == ["secret", "step-00000001"]
    assert not list((place.canary / "step-00000001").iterdir())
    after = place.outside_root()
    assert after == place.before, {k: (place.before.get(k), after.get(k)) for k in set(after) ^ set(place.before) | {k for k in after if after[k] != place.before.get(k)}}
    assert not ESCAPE.exists(), f"{ESCAPE} was created by a request"
    # the servicers log every INTERNAL ("<RPC> failed" and a traceback); planning errors are "internal error while planning"
    log = place.daemon.log_text()
    unexpected = [line for line in log.splitlines() if re.search(r"servicer: \w+ failed|internal error", line)]
    assert not unexpected, "\n".join(unexpected[:20])


# ------------------------------------------------------------------ strategies

_SAFE_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


def hostile_names(place: Place) -> st.SearchStrategy[str]:
    """Strings for names, ids and paths: hostile ones, arbitrary text and valid job ids."""
    specials = [
        "", ".", "..", "../", "../..", "../../etc/passwd", "../canary/secret", "../../canary", "real/../real", "..\\..\\x",
        "/etc/passwd", "/", "//", str(place.canary), str(place.canary / "secret"), str(ESCAPE), str(ESCAPE / "x"),
        "a\x00b", "\x00", "x\n", "\t", " ", " x", "x ", "-x", "%2e%2e%2f", "\u202e", "é漢字🙂", "\ufeff", "CON", "*", "?",
        "x" * 128, "x" * 129, "y" * 5000, "latest", ".recycle", "ckptd.index.json", "extra.json", "step-00000001",
        "model-00001-of-00001.safetensors", "__metadata__", "model/__metadata__", "model/w", "real", "fz", "a",
        *place.step_files, *("../" + name for name in place.step_files), *("." + name for name in place.step_files),
    ]
    return st.one_of(st.sampled_from(specials), _SAFE_TEXT, st.from_regex(JOB_ID_PATTERN, fullmatch=True))


def jobs(place: Place) -> st.SearchStrategy[str]:
    """Job ids: mostly a few valid ones (requests reach the service), else hostile names."""
    return st.one_of(st.sampled_from(["fz", "fz2", "real"]), hostile_names(place))


def int64s() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(-2, 8), st.sampled_from([-1, INT64[0], INT64[1], 2**31, -(2**31), 2**48, 2**53, 2**62]), st.integers(*INT64)
    )


def int32s() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-2, 8), st.sampled_from([-1, INT32[0], INT32[1], 2**20, 2**20 + 1]), st.integers(*INT32))


def doubles() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, -0.0, -1.0, 0.5, 1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324]), st.floats())


def timeouts() -> st.SearchStrategy[float]:
    """Short waits (a request that blocks costs little), and hostile values."""
    return st.one_of(st.sampled_from([0.05, 0.1, 0.3]), st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 8 * 86400.0, 5e-324]))


def dims() -> st.SearchStrategy[int]:
    """A dimension: small (a valid tensor stays small: no arena fills /dev/shm) or absurd (refused)."""
    return st.one_of(st.integers(0, 16), st.sampled_from([-1, INT64[0], INT64[1], 2**49, 2**62]))


def boxes(ndim: int | None = None) -> st.SearchStrategy[pb.Box]:
    size = st.integers(0, 4) if ndim is None else st.just(ndim)
    return size.flatmap(lambda n: st.builds(pb.Box, offsets=st.lists(dims(), min_size=n, max_size=n), lengths=st.lists(dims(), min_size=n, max_size=n)))


def valid_metas(prefix: str = "model/") -> st.SearchStrategy[list[pb.TensorMeta]]:
    """A well-formed tensor list: distinct names, small shapes, full boxes."""

    def build(shapes: list[list[int]]) -> list[pb.TensorMeta]:
        return [
            pb.TensorMeta(name=f"{prefix}t{i}", kind="model", dtype="F32", shape=s, box=pb.Box(offsets=[0] * len(s), lengths=s))
            for i, s in enumerate(shapes)
        ]

    return st.lists(st.lists(st.integers(1, 8), min_size=0, max_size=2), min_size=1, max_size=4).map(build)


def hostile_metas(place: Place) -> st.SearchStrategy[pb.TensorMeta]:
    return st.builds(
        pb.TensorMeta,
        name=st.one_of(st.sampled_from(["model/w", "model/t0", "optimizer/state/0/exp_avg"]), hostile_names(place)),
        kind=st.sampled_from([*KINDS, "", "Model", "weights", "../model", "model\x00"]),
        dtype=st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "BOOL", "F8_E4M3", "", "f32", "F33", "complex64", "F32\x00"]),
        shape=st.lists(dims(), max_size=5),
        box=st.one_of(st.none(), boxes()),
        aliases=st.lists(hostile_names(place), max_size=2),
    )


def huge_metas() -> st.SearchStrategy[list[pb.TensorMeta]]:
    """A huge repeated field: many tensors, distinct or all of one name."""
    return st.tuples(st.integers(2_000, 30_000), st.booleans()).map(
        lambda nd: [pb.TensorMeta(name="model/same" if nd[1] else f"model/t{i}", kind="model", dtype="U8", shape=[1]) for i in range(nd[0])]
    )


def metas(place: Place) -> st.SearchStrategy[list[pb.TensorMeta]]:
    return st.one_of(valid_metas(), st.lists(hostile_metas(place), max_size=4), huge_metas())


def run_ids(place: Place) -> st.SearchStrategy[str]:
    """Run ids: none (a client older than run ids), a few valid ones, hostile names."""
    return st.one_of(st.sampled_from(["", "", "run-a", "run-b", "0123456789abcdef0123456789abcdef"]), hostile_names(place))


def client_ids(place: Place) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(["", "client0123456789", "c" * 64, "c" * 65, "short"]), hostile_names(place))


def who(place: Place) -> st.SearchStrategy[pb.RankId]:
    valid = st.builds(
        pb.RankId, job=st.sampled_from(["fz", "fz2"]), rank=st.just(0), world_size=st.just(1), local_world_size=st.sampled_from([0, 1]),
        run_id=st.sampled_from(["", "run-a", "run-b"]), client_id=st.sampled_from(["", "client0123456789"]),
    )
    hostile = st.builds(
        pb.RankId, job=jobs(place), rank=int32s(), world_size=int32s(), local_world_size=int32s(), run_id=run_ids(place), client_id=client_ids(place)
    )
    return st.one_of(valid, hostile, st.just(pb.RankId()))


def json_texts() -> st.SearchStrategy[str]:
    deep = st.integers(1, 200_000).map(lambda n: "[" * n + "]" * n)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), _SAFE_TEXT)
    documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_SAFE_TEXT, inner, max_size=3)), max_leaves=8)
    return st.one_of(
        st.just(""), st.sampled_from(["{", "}", "null", "[]", "NaN", '{"a": Infinity}', "1e999999", '"\\ud800"', "{}" * 3, "\x00", "[" * 100]),
        documents.map(json.dumps), deep, _SAFE_TEXT,
        st.integers(1, 3).map(lambda n: json.dumps({"x": "y" * (n * 3 * 2**20)})),  # larger than the limits
    )


# ------------------------------------------------------------------ calling


@dataclass
class Caller:
    """Sends a request, checks the status it gets, counts it."""

    counts: collections.Counter[str]
    metadata: tuple[tuple[str, str], ...] = ()

    def unary(self, name: str, method: Callable[..., Any], request: Any, **kwargs: Any) -> tuple[grpc.StatusCode, Any]:
        self.counts[name] += 1
        try:
            reply = method(request, timeout=CALL_TIMEOUT_S, metadata=self.metadata, **kwargs)
        except grpc.RpcError as exc:
            _check_status(name, exc.code(), exc.details(), request)
            return exc.code(), None
        return grpc.StatusCode.OK, reply

    def stream(
        self, name: str, method: Callable[..., Any], request: Any, limit: int = 64, timeout_s: float = CALL_TIMEOUT_S
    ) -> tuple[grpc.StatusCode, list[Any]]:
        self.counts[name] += 1
        replies = []
        try:
            for reply in method(request, timeout=timeout_s, metadata=self.metadata):
                replies.append(reply)
                if len(replies) >= limit:
                    break
        except grpc.RpcError as exc:
            _check_status(name, exc.code(), exc.details(), request)
            return exc.code(), replies
        return grpc.StatusCode.OK, replies


def _check_status(name: str, code: grpc.StatusCode, details: str | None, request: Any) -> None:
    shown = str(request)
    shown = shown if len(shown) < 3000 else shown[:3000] + "..."
    assert code not in BAD, f"{name} answered {code.name}: {details}\nrequest:\n{shown}"
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED or details, f"{name} answered {code.name} without saying why\nrequest:\n{shown}"


def _begin(stub: pb_grpc.CheckpointStub, job: str, step: int) -> pb.BeginSaveResponse:
    """A valid BeginSave of one rank (its save_id and arena are real)."""
    meta = pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[0], lengths=[4]))
    return stub.BeginSave(
        pb.BeginSaveRequest(who=pb.RankId(job=job, rank=0, world_size=1), step=step, fingerprint="fp", tensors=[meta], timeout_s=30), timeout=30
    )


def _save_to_target(data: st.DataObject, single: Place, stub: pb_grpc.CheckpointStub, job: str, fresh_steps: Iterator[int]) -> tuple[pb.RankId, str, bool]:
    """(who, save_id, real) for a commit-side request: hostile ones half the time, else those of
    a save of `job` begun just before (real: the request gets past the "unknown save" check)."""
    if data.draw(st.booleans()):
        return pb.RankId(job=job, rank=0, world_size=1), _begin(stub, job, next(fresh_steps)).save_id, True
    return data.draw(who(single)), data.draw(hostile_names(single)), False


# ------------------------------------------------------------------ ckptd.v1.Checkpoint


@pytest.fixture(scope="module")
def stub(single: Place) -> Iterator[pb_grpc.CheckpointStub]:
    with grpc.insecure_channel(single.daemon.address, options=[("grpc.max_send_message_length", 256 * 2**20)]) as channel:
        yield pb_grpc.CheckpointStub(channel)


@pytest.fixture(scope="module")
def fresh_steps() -> Iterator[Iterator[int]]:
    """Step numbers never used before in this module (for saves begun to be committed or aborted)."""
    yield iter(range(1000, 10**9))


def test_fuzz_begin_save(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        request = pb.BeginSaveRequest(
            who=data.draw(who(single)),
            step=data.draw(int64s()),
            fingerprint=data.draw(st.one_of(st.sampled_from(["fp", "fp2"]), hostile_names(single))),
            tensors=data.draw(st.one_of(metas(single), st.just([]))),
            quantize=data.draw(st.sampled_from(["", "O1", "O2", "O3", "none", "o1", "\x00"])),
            metric=data.draw(doubles()),
            has_metric=data.draw(st.booleans()),
            timeout_s=data.draw(timeouts()),
            master_weights=data.draw(st.sampled_from(["", "keep", "drop", "residual", "KEEP", "lose"])),
            lineage_generation=data.draw(int32s()),
            no_quantize=data.draw(st.booleans()),
            known_layout=data.draw(st.one_of(st.just(""), hostile_names(single))),
            resumed=data.draw(st.booleans()),
            resumed_from=data.draw(int64s()),
        )
        caller.unary("Checkpoint.BeginSave", stub.BeginSave, request)

    run()


def test_fuzz_commit_snapshot(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fresh_steps: Iterator[int], fuzz: settings) -> None:
    """Half the commits are for a save begun just before (a real save_id), the rest for none."""
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        rank_id, save_id, real = _save_to_target(data, single, stub, "fzc", fresh_steps)
        if real and data.draw(st.booleans()):  # a real save, the wrong rank
            rank_id = data.draw(st.one_of(who(single), st.just(pb.RankId(job="fzc", rank=1, world_size=2))))
        request = pb.CommitSnapshotRequest(
            who=rank_id,
            save_id=save_id,
            extras_json=data.draw(json_texts()),
            model_files=data.draw(st.dictionaries(st.one_of(st.sampled_from(["config.json", "generation_config.json"]), hostile_names(single)), json_texts(), max_size=3)),
            stall_s=data.draw(doubles()),
            staging_id=data.draw(st.one_of(st.just(""), hostile_names(single))),
            staged=data.draw(
                st.one_of(
                    st.lists(st.builds(pb.StagedRange, staging_offset=int64s(), arena_offset=int64s(), nbytes=int64s()), max_size=4),
                    st.integers(1000, 200_000).map(lambda n: [pb.StagedRange(nbytes=1)] * n),
                )
            ),
        )
        caller.unary("Checkpoint.CommitSnapshot", stub.CommitSnapshot, request)

    run()


def test_fuzz_abort_save(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fresh_steps: Iterator[int], fuzz: settings) -> None:
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        rank_id, save_id, _ = _save_to_target(data, single, stub, "fza", fresh_steps)
        reason = data.draw(st.one_of(hostile_names(single), st.integers(0, 3).map(lambda n: "r" * (n * 2**20))))
        caller.unary("Checkpoint.AbortSave", stub.AbortSave, pb.AbortSaveRequest(who=rank_id, save_id=save_id, reason=reason))

    run()


def test_fuzz_wait_durable(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        request = pb.WaitDurableRequest(
            job=data.draw(jobs(single)), step=data.draw(st.one_of(st.just(1), int64s())), timeout_s=data.draw(timeouts())
        )
        caller.stream("Checkpoint.WaitDurable", stub.WaitDurable, request)

    run()


def test_fuzz_plan_load(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    caller = Caller(counts)
    real = [
        pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[3, 4], box=pb.Box(offsets=[0, 0], lengths=[3, 4])),
        pb.TensorMeta(name="model/b", kind="model", dtype="F32", shape=[5]),
    ]

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        rank_id = data.draw(st.one_of(st.just(pb.RankId(job="real", rank=0, world_size=1)), who(single)))
        request = pb.PlanLoadRequest(
            who=rank_id,
            step=data.draw(st.one_of(st.just(1), int64s())),
            latest=data.draw(st.booleans()),
            tensors=data.draw(st.one_of(st.just(real), st.just([]), metas(single))),
            kinds=data.draw(st.one_of(st.just(["model"]), st.lists(hostile_names(single), max_size=3))),
            strict=data.draw(st.booleans()),
            direct_read=data.draw(st.booleans()),
            decodes=data.draw(st.booleans()),
            decodes_frames=data.draw(st.booleans()),
            fingerprint=data.draw(st.one_of(st.just(""), st.just("fp"), hostile_names(single))),
            known_plans=data.draw(st.one_of(st.lists(hostile_names(single), max_size=9), st.integers(9, 50_000).map(lambda n: ["p"] * n))),
        )
        code, reply = caller.unary("Checkpoint.PlanLoad", stub.PlanLoad, request)
        if reply is not None:
            for piece in reply.pieces:  # nothing outside the root or the daemon's memory is named
                assert ".." not in Path(piece.path).parts and not piece.path.startswith(str(single.canary)), piece
            caller.unary("Checkpoint.LoadDone", stub.LoadDone, pb.LoadDoneRequest(who=rank_id, load_id=reply.load_id))

    run()


def test_fuzz_load_done(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        request = pb.LoadDoneRequest(who=data.draw(who(single)), load_id=data.draw(hostile_names(single)))
        caller.unary("Checkpoint.LoadDone", stub.LoadDone, request)

    run()


def test_fuzz_held_arena(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    """HeldArena names nothing but an arena of the daemon's: never the canary, never a path
    outside its shared-memory directory."""
    caller = Caller(counts)
    known = stub.HeldArena(pb.HeldArenaRequest(who=pb.RankId(job="real", rank=0, world_size=1)), timeout=10)
    assert known.step == 1 and known.nbytes > 0 and Path(known.path).name.startswith("ckptd-")  # "real"'s step is held
    arenas = Path(known.path).parent

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        code, reply = caller.unary("Checkpoint.HeldArena", stub.HeldArena, pb.HeldArenaRequest(who=data.draw(who(single))))
        if reply is not None and reply.path:
            assert str(single.canary) not in reply.path and Path(reply.path).parent == arenas and Path(reply.path).name.startswith("ckptd-"), reply
            assert reply.step > 0 and reply.nbytes > 0

    run()


def test_fuzz_list_status_collect(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    """The queries and gc: List, Status and Collect (dry runs and real ones)."""
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        job = data.draw(jobs(single))
        code, reply = caller.unary("Checkpoint.List", stub.List, pb.ListRequest(job=job))
        if reply is not None:
            assert all(str(single.canary) not in c.path for c in reply.checkpoints)
        caller.unary("Checkpoint.Status", stub.Status, pb.StatusRequest(job=data.draw(jobs(single))))
        dry_run = data.draw(st.booleans())
        collect_job = data.draw(st.one_of(jobs(single), st.just("")))
        if collect_job in ("", "real") and not dry_run:
            collect_job = "fz"  # keep the committed step the other requests load
        caller.unary("Checkpoint.Collect", stub.Collect, pb.CollectRequest(job=collect_job, dry_run=dry_run))

    run()


def test_fuzz_open_close_staging(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    """OpenStaging on a daemon without CUDA: refused or answered with a reason, never INTERNAL."""
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        request = pb.OpenStagingRequest(
            who=data.draw(who(single)),
            gpu_uuid=data.draw(st.one_of(st.just("0" * 32), st.from_regex(r"[0-9a-f]{32}", fullmatch=True), hostile_names(single))),
            ipc_handle=data.draw(st.one_of(st.binary(min_size=64, max_size=64), st.binary(max_size=200), st.just(b"\x00" * 64))),
            nbytes=data.draw(int64s()),
            pid=data.draw(st.one_of(st.just(os.getpid()), int32s())),
        )
        code, reply = caller.unary("Checkpoint.OpenStaging", stub.OpenStaging, request)
        staging_id = reply.staging_id if reply is not None and reply.staging_id else data.draw(hostile_names(single))
        caller.unary("Checkpoint.CloseStaging", stub.CloseStaging, pb.CloseStagingRequest(who=data.draw(who(single)), staging_id=staging_id))

    run()


# issue 30 finding 6: the run calls
def test_fuzz_attach_detach(single: Place, stub: pb_grpc.CheckpointStub, counts: collections.Counter[str], fuzz: settings) -> None:
    """Attach (a stream that stays open while the client lives: a valid one answers one event and
    then runs into the short deadline) and Detach, with hostile run and client ids."""
    caller = Caller(counts)

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        request = pb.AttachRequest(who=data.draw(who(single)), pid=data.draw(int32s()), host=data.draw(hostile_names(single)))
        code, events = caller.stream("Checkpoint.Attach", stub.Attach, request, timeout_s=0.3)
        assert code != grpc.StatusCode.OK, "an Attach call ended by itself"
        assert len(events) <= 1
        caller.unary("Checkpoint.Detach", stub.Detach, pb.DetachRequest(who=data.draw(st.one_of(st.just(request.who), who(single)))))

    run()


# ------------------------------------------------------------------ ckptd.v1.Peer


@pytest.fixture(scope="module")
def peer_stubs(cluster: tuple[list[str], list[Place]]) -> Iterator[list[ppb_grpc.PeerStub]]:
    peers, _ = cluster
    channels = [grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 * 2**20)]) for address in peers]
    yield [ppb_grpc.PeerStub(channel) for channel in channels]
    for channel in channels:
        channel.close()


def tokens() -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    """Mostly the right token (the request reaches the handler), sometimes none or a wrong one."""
    return st.one_of(
        st.just(((TOKEN_KEY, TOKEN),)),
        st.just(((TOKEN_KEY, TOKEN),)),
        st.just(((TOKEN_KEY, TOKEN),)),
        st.sampled_from([(), ((TOKEN_KEY, ""),), ((TOKEN_KEY, TOKEN[:-1]),), ((TOKEN_KEY, TOKEN + "x"),), ((TOKEN_KEY, "x" * 4096),), ((TOKEN_KEY, " " + TOKEN),)]),
    )


def _peer_caller(counts: collections.Counter[str], metadata: tuple[tuple[str, str], ...]) -> Caller:
    return Caller(counts, metadata)


def _check_refused(metadata: tuple[tuple[str, str], ...], code: grpc.StatusCode) -> None:
    if metadata != ((TOKEN_KEY, TOKEN),):
        assert code == grpc.StatusCode.UNAUTHENTICATED, f"a call with metadata {metadata} got {code.name}"


def peer_tensors(place: Place) -> st.SearchStrategy[list[ppb.RankTensors]]:
    return st.lists(
        st.builds(ppb.RankTensors, rank=int32s(), fingerprint=st.one_of(st.just("fp"), hostile_names(place)), tensors=metas(place)), max_size=3
    )


def test_fuzz_peer_join_save(cluster: tuple[list[str], list[Place]], peer_stubs: list[ppb_grpc.PeerStub], counts: collections.Counter[str], fuzz: settings) -> None:
    _, places = cluster
    place = places[0]

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        metadata = data.draw(tokens())
        node = data.draw(st.sampled_from([0, 0, 0, 1]))
        valid = data.draw(st.booleans())
        if valid:  # well-formed: one node's ranks with their metadata
            world = data.draw(st.integers(1, 3))
            described = {r: data.draw(valid_metas()) for r in range(data.draw(st.integers(1, world)))}
            fingerprints = {r: metadata_digest(metas) for r, metas in described.items()}
            tensors = [ppb.RankTensors(rank=r, fingerprint=fingerprints[r], tensors=metas) for r, metas in described.items()]
        else:
            world = data.draw(int32s())
            fingerprints = data.draw(st.dictionaries(int32s(), st.one_of(st.just("fp"), hostile_names(place)), max_size=4))
            tensors = data.draw(peer_tensors(place))
        request = ppb.JoinSaveRequest(
            job=data.draw(jobs(place)), step=data.draw(int64s()), node=data.draw(st.one_of(st.sampled_from([0, 1]), int32s())),
            world_size=world, fingerprints=fingerprints, tensors=tensors,
            known_plans=data.draw(st.one_of(st.lists(hostile_names(place), max_size=3), st.integers(1000, 50_000).map(lambda n: ["k"] * n))),
            timeout_s=data.draw(timeouts()), metric=data.draw(doubles()), has_metric=data.draw(st.booleans()),
            root_id=data.draw(st.one_of(st.just(""), hostile_names(place))),
            quantize=data.draw(st.one_of(st.sampled_from(["", "O1", "O2", "o1"]), hostile_names(place))),
            master_weights=data.draw(st.one_of(st.sampled_from(["", "keep", "drop", "residual"]), hostile_names(place))),
            no_quantize=data.draw(st.booleans()), lineage=data.draw(int32s()),
            run_id=data.draw(run_ids(place)), resumed=data.draw(st.booleans()),
        )
        code, _ = _peer_caller(counts, metadata).unary("Peer.JoinSave", peer_stubs[node].JoinSave, request)
        _check_refused(metadata, code)

    run()


def fragments(place: Place) -> st.SearchStrategy[list[ppb.StoredFragment]]:
    fragment = st.builds(
        ppb.StoredFragment,
        name=st.one_of(st.just("model/w"), hostile_names(place)),
        file=st.one_of(st.sampled_from(place.step_files), hostile_names(place)),
        key=hostile_names(place),
        box=st.one_of(st.none(), boxes()),
        dtype=st.sampled_from(["F32", "", "F33", "BF16"]),
        offset=int64s(), nbytes=int64s(), checksum=hostile_names(place), chunk_bytes=int64s(), chunk_xxh3=hostile_names(place),
        quant_json=st.one_of(st.just(""), json_texts()),
    )
    return st.lists(fragment, max_size=3)


def _join_as(stub: ppb_grpc.PeerStub, node: int, job: str, step: int, tensors: list[pb.TensorMeta]) -> ppb.JoinSaveResponse:
    """A JoinSave of `node` with the only rank of a job: the coordinator plans it and waits for that node's manifest."""
    digest = metadata_digest(tensors)
    request = ppb.JoinSaveRequest(
        job=job, step=step, node=node, world_size=1, fingerprints={0: digest}, tensors=[ppb.RankTensors(rank=0, fingerprint=digest, tensors=tensors)],
        timeout_s=30, root_id="fuzz-root",
    )
    return stub.JoinSave(request, metadata=((TOKEN_KEY, TOKEN),), timeout=30)


def test_fuzz_peer_report_manifest(
    cluster: tuple[list[str], list[Place]], peer_stubs: list[ppb_grpc.PeerStub], counts: collections.Counter[str], fresh_steps: Iterator[int],
    fuzz: settings,
) -> None:
    """Half the manifests are for a save joined just before (they reach the commit), the rest for none."""
    _, places = cluster
    place = places[0]

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        metadata = data.draw(tokens())
        node = data.draw(st.sampled_from([0, 0, 0, 1]))
        job, step, save_id = data.draw(jobs(place)), data.draw(int64s()), data.draw(hostile_names(place))
        reporter = data.draw(st.one_of(st.sampled_from([0, 1]), int32s()))
        if data.draw(st.booleans()):  # a save joined just before: the coordinator takes the manifest
            node, reporter, job, step = 0, data.draw(st.sampled_from([0, 1])), "fzm", next(fresh_steps)
            save_id = _join_as(peer_stubs[0], reporter, job, step, data.draw(valid_metas())).save_id
        request = ppb.ReportManifestRequest(
            job=job, step=step, save_id=save_id,
            node=reporter, ok=data.draw(st.booleans()), error=data.draw(hostile_names(place)),
            files=data.draw(st.lists(st.builds(ppb.FileEntry, name=hostile_names(place), size=int64s(), checksum=hostile_names(place)), max_size=3)),
            fragments=data.draw(fragments(place)),
            extras_json=data.draw(st.dictionaries(int32s(), json_texts(), max_size=3)),
            model_files=data.draw(st.dictionaries(st.one_of(st.just("config.json"), hostile_names(place)), json_texts(), max_size=2)),
        )
        code, _ = _peer_caller(counts, metadata).unary("Peer.ReportManifest", peer_stubs[node].ReportManifest, request)
        _check_refused(metadata, code)

    run()


def test_fuzz_peer_inventory(cluster: tuple[list[str], list[Place]], peer_stubs: list[ppb_grpc.PeerStub], counts: collections.Counter[str], fuzz: settings) -> None:
    _, places = cluster
    place = places[0]

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        metadata = data.draw(tokens())
        node = data.draw(st.sampled_from([0, 1]))
        request = ppb.InventoryRequest(job=data.draw(jobs(place)), step=data.draw(st.one_of(st.just(1), int64s())), run_id=data.draw(run_ids(place)))
        code, reply = _peer_caller(counts, metadata).unary("Peer.Inventory", peer_stubs[node].Inventory, request)
        _check_refused(metadata, code)
        if reply is not None:
            assert all("/" not in f.name for f in reply.files)

    run()


def test_fuzz_peer_fetch(cluster: tuple[list[str], list[Place]], peer_stubs: list[ppb_grpc.PeerStub], counts: collections.Counter[str], fuzz: settings) -> None:
    """Fetch serves bytes of a committed step's files and nothing else (the canary never leaks)."""
    _, places = cluster
    place = places[0]

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        metadata = data.draw(tokens())
        node = data.draw(st.sampled_from([0, 0, 1]))
        request = ppb.FetchRequest(
            job=data.draw(st.one_of(st.just("real"), jobs(place))), step=data.draw(st.one_of(st.just(1), int64s())),
            file=data.draw(hostile_names(place)), offset=data.draw(st.one_of(st.integers(0, 64), int64s())),
            nbytes=data.draw(st.one_of(st.integers(0, 64), int64s())),
        )
        code, chunks = _peer_caller(counts, metadata).stream("Peer.Fetch", peer_stubs[node].Fetch, request)
        _check_refused(metadata, code)
        served = b"".join(c.data for c in chunks)
        assert place.secret not in served
        if served:
            assert request.file in place.step_files and request.job == "real" and request.step == 1, request

    run()


def test_fuzz_peer_replica_calls(cluster: tuple[list[str], list[Place]], peer_stubs: list[ppb_grpc.PeerStub], counts: collections.Counter[str], fuzz: settings) -> None:
    """Tier 0b's calls: offers, reads of replicas, holder reports and questions for held parts
    with hostile names, sizes, nodes and ranges are refused with a reason (never INTERNAL); a
    ticket is given only for a replica that is held, or an offer of plain file names that fits
    the budget."""
    _, places = cluster
    place = places[0]

    @fuzz
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        metadata = data.draw(tokens())
        node = data.draw(st.sampled_from([0, 1]))
        job = data.draw(st.one_of(st.just("real"), jobs(place)))
        step = data.draw(st.one_of(st.just(1), int64s()))
        source = data.draw(st.one_of(st.sampled_from([0, 1, 2]), int32s()))
        call = data.draw(st.sampled_from(["offer", "read", "held", "parts"]))
        caller = _peer_caller(counts, metadata)
        if call == "offer":
            files = data.draw(st.lists(st.builds(ppb.FileEntry, name=hostile_names(place), size=st.one_of(st.integers(0, 4096), int64s()),
                                                 checksum=st.one_of(st.just("xxh3-64:0000000000000000"), st.text(max_size=40))), max_size=4))
            request = ppb.OfferReplicaRequest(job=job, step=step, node=source, files=files)
            code, reply = caller.unary("Peer.OfferReplica", peer_stubs[node].OfferReplica, request)
            if reply is not None and reply.accepted and not reply.held:
                assert all("/" not in f.name and f.name not in ("", ".", "..") and 0 <= f.size for f in files), request
                assert len(reply.ticket) == 32 and reply.port > 0
        elif call == "read":
            ranges = data.draw(st.lists(st.builds(ppb.ReplicaRange, file=hostile_names(place), offset=st.one_of(st.integers(0, 64), int64s()),
                                                  nbytes=st.one_of(st.integers(0, 64), int64s())), max_size=4))
            request = ppb.ReadReplicaRequest(job=job, step=step, node=source, ranges=ranges)
            code, reply = caller.unary("Peer.ReadReplica", peer_stubs[node].ReadReplica, request)
            assert reply is None or not reply.accepted or (job == "real" and step == 1), request  # nothing is held but the real step
        elif call == "held":
            holders = data.draw(st.lists(st.one_of(st.sampled_from([0, 1, 2]), int32s()), max_size=4))
            request = ppb.ReplicaHeldRequest(job=job, step=step, node=source, holders=holders, error=data.draw(st.text(max_size=64)))
            code, _ = caller.unary("Peer.ReplicaHeld", peer_stubs[node].ReplicaHeld, request)
        else:
            code, parts = caller.unary("Peer.HeldParts", peer_stubs[node].HeldParts, ppb.HeldPartsRequest(node=source))
            assert parts is None or all(p.holders for p in parts.parts), parts
        _check_refused(metadata, code)

    run()


# ------------------------------------------------------------------ what the fuzzer found

DEEP = "[" * 100_000 + "]" * 100_000  # deeper than the JSON parser goes (was INTERNAL: RecursionError)


@pytest.mark.parametrize("depth", [300, 100_000])
def test_model_files_nested_too_deep_are_refused(single: Place, stub: pb_grpc.CheckpointStub, fresh_steps: Iterator[int], depth: int) -> None:
    save_id = _begin(stub, "fzd", next(fresh_steps)).save_id
    request = pb.CommitSnapshotRequest(
        who=pb.RankId(job="fzd", rank=0, world_size=1), save_id=save_id, model_files={"config.json": "[" * depth + "]" * depth}
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.CommitSnapshot(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model file config.json nests deeper than 256 JSON levels" in info.value.details()


@pytest.mark.parametrize("field_name", ["extras_json", "model_files", "quant_json"])
def test_a_manifest_with_json_nested_too_deep_is_refused(
    cluster: tuple[list[str], list[Place]], peer_stubs: list[ppb_grpc.PeerStub], fresh_steps: Iterator[int], field_name: str
) -> None:
    step = next(fresh_steps)
    tensors = [pb.TensorMeta(name="model/t0", kind="model", dtype="F32", shape=[2], box=pb.Box(offsets=[0], lengths=[2]))]
    save_id = _join_as(peer_stubs[0], 0, "fzd", step, tensors).save_id
    request = ppb.ReportManifestRequest(job="fzd", step=step, save_id=save_id, node=0, ok=True)
    if field_name == "extras_json":
        request.extras_json[0] = DEEP
    elif field_name == "model_files":
        request.model_files["config.json"] = DEEP
    else:
        request.fragments.append(ppb.StoredFragment(name="model/t0", file="model-00001-of-00001.safetensors", quant_json=DEEP))
    with pytest.raises(grpc.RpcError) as info:
        peer_stubs[0].ReportManifest(request, metadata=((TOKEN_KEY, TOKEN),), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "nests deeper than 256 JSON levels" in info.value.details()
