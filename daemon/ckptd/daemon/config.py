"""The daemon's configuration: flags > CKPTD_* environment variables > TOML file > defaults.

Each setting has one name, the `DaemonConfig` field name; the same name, spelled per source:

- flag: `--` + the name with dashes (`--max-inflight`); exceptions: `save_timeout_s` is `--save-timeout`,
  `idle_release_s` is `--idle-release`;
- environment: `CKPTD_` + the name upper-cased (`CKPTD_MAX_INFLIGHT`); an empty value counts as unset;
- TOML file (`--config FILE`, else `$CKPTD_CONFIG`): a top-level key (`max_inflight = 2`); the retention
  settings may instead sit in a `[retention]` table (`keep_last`, `keep_every`, `keep_best`, `best_mode`).
  Relative paths in the file are relative to the file's directory. Unknown keys are errors.

deploy/ckptd.example.toml lists every setting with its default.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Final, Mapping

from ckptd.common.codecs import builtin as builtin_codecs
from ckptd.common.names import decimal
from ckptd.common.paths import default_root, default_socket
from ckptd.common.quant_options import MASTER_MODES, SCHEMES
from ckptd.daemon.handoff.shm_dir import ShmBudget
from ckptd.daemon.peer_settings import peer_problems
from ckptd.daemon.plan.retention import BEST_MODES, RetentionPolicy
from ckptd.daemon.thread_priority import BackgroundPriority, PriorityError, cpus_setting, ionice_setting, nice_setting

GiB: Final = 1 << 30
ENV_PREFIX: Final = "CKPTD_"
CONFIG_ENV: Final = "CKPTD_CONFIG"
RETENTION_TABLE: Final = "retention"
RETENTION_KEYS: Final = ("keep_last", "keep_every", "keep_best", "best_mode")
ARENA_POLICIES: Final = ("wait", "skip")
LOAD_BROADCAST: Final = ("auto", "on", "off")
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")

_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off")
_SIZE_UNITS: Final = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_PATTERN: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


class ConfigError(ValueError):
    """A setting that is missing, malformed or out of range; the message names the setting and where it came from."""


class _Expected(Exception):
    """Raised by a parser: carries what the value should have been (e.g. 'an integer >= 1')."""


@dataclass(frozen=True)
class DaemonConfig:
    """Everything `ckptd serve` needs. Fields are validated (and str paths made Path) at construction.

    root: storage root; checkpoints live under <root>/<job>/step-<8 digits>/.
    socket: the Unix socket ranks connect to.
    shm_dir: where the shared-memory arenas live (a tmpfs, normally /dev/shm).
    arena_policy: what a save does when none of its rank's arenas is free: "wait" (backpressure)
        or "skip" (the checkpoint is skipped and reported on the handle).
    max_inflight: arena sets (snapshots) per job, so a save can start while older ones are written;
        the second is made only when a save finds none idle, and given back once idle again.
    shm_budget: the most shared memory the arenas of all jobs take together (bytes, a share of
        the host's memory, or none: the shm_dir's size); see docs/operations.md, Memory.
    hold_while_saving: keep the newest committed snapshot while the next save fills a second
        arena set (when max_inflight and the budget allow; 2x the state per job); off: the next
        save reuses the held snapshot's arenas (1x), so that step restores from disk meanwhile.
    idle_release_s: give back the arenas of a job with no save or load for this long; 0 = never.
    keep_last: retention, the number of newest committed steps to keep; 0 = keep all.
    keep_every: retention, also keep every step divisible by this forever; 0 = off.
    write_threads: threads that write and fsync files.
    max_file_bytes: model/optimizer files are split above this size, in bytes.
    link_unchanged: incremental saves: a file of frozen tensors (parameters with
        requires_grad=False, buffers) whose bytes did not change since the job's previous step
        is hard-linked into the new step instead of written again.
    save_timeout_s: seconds all ranks may take to arrive at and commit a snapshot.
    write_throttle: limit on the write rate in bytes per second (a slow disk for tests and drills); 0 = off.
    disk_reserve: bytes to leave free on the storage root's file system: a save whose files would
        leave less is refused before anything of it is written (0: the files only have to fit).
        Default 1 GiB, a fixed amount rather than a share of the file system (1% of a shared
        100 TB file system would hold back 1 TB; of a 50 GB disk, 500 MB): it covers what the
        check leaves out (the step's small files: indexes, extra.json), file system overhead, and
        leaves the node room to run (logs) when checkpoints fill its disk.
    background_nice, background_ionice, background_cpus: what the threads that persist, write,
        hash, replicate and upload run at (thread_priority.BackgroundPriority); off by default: on
        a trainer using every core, nice 10 lengthened the save's window more than it spared the
        steps (docs/benchmarks.md, training time lost per save).
    log_level: one of debug, info, warning, error, critical.
    log_json: one JSON object per log line instead of plain text.
    node_rank: this daemon's place in `peers` (several nodes); node 0 coordinates.
    peers: every node's daemon-to-daemon address "host:port", in node-rank order; this daemon
        listens on its own entry. Empty: a single node.
    peer_token: the shared secret every daemon of the job's nodes presents (required with peers).
    peer_tls_cert, peer_tls_key, peer_tls_ca: PEM files for mutual TLS on the peer port (all
        three or none): this daemon's certificate and key, and the CA that signed every daemon's.
    keep_best: retention, also keep the N committed steps with the best `metric` given to save(); 0 = off.
    best_mode: "min" (a lower metric is better, e.g. a loss) or "max" (higher is better, e.g. accuracy).
    metrics_port: TCP port of the Prometheus endpoint (http://HOST:PORT/metrics); 0 = no endpoint.
    metrics_host: address the metrics and health endpoints listen on ("0.0.0.0": every interface).
    health_port: TCP port of a gRPC health service (grpc.health.v1) for probes such as Kubernetes'
        `grpc:` liveness/readiness probes; 0 = none (health is always on the Unix socket).
    quantize: the default compression of optimizer moments for saves that do not choose:
        "none" (lossless), "O1" (int8) or "O2" (int4) (docs/architecture.md §8).
    master_weights: the default for fp32 master weights beside bf16/fp16 model weights:
        "keep", "drop" (rebuilt from the model weights on load) or "residual" (bf16 difference).
    quant_max_generations: lossy save/restore cycles allowed in a lineage: once a trainer resumed
        from a checkpoint with this many behind its values, its saves are lossless (no
        quantization, master weights kept); 0 = no limit.
    replicas, replica_*: the replica tiers (docs/operations.md): node i's newest committed part is held in the memory
        of nodes i+1..i+replicas (0 = off), sent at most at replica_bandwidth bytes/s (0 = unlimited),
        within replica_memory bytes per holder, over the bulk port replica_port (0 = a free port).
        replica_prefetch: a replaced node stages its part from the replicas before its ranks ask (engine/prefetch.py).
    load_broadcast: "auto" (node-local roots: a file other nodes need is read once by its writer for all of them), "on"
        (also a shared root: a file another node wrote is fetched from its writer instead of read from storage) or "off".
    remote, remote_*: the object-store tier "s3://BUCKET/PREFIX" ("" = none), requests in flight,
        multipart part size (>= 5 MiB), and the bucket's retention (keep_last 0 = keep all;
        keep_every 0 = off): docs/operations.md, Object store.
    """

    root: Path
    socket: Path
    shm_dir: Path = Path("/dev/shm")
    arena_policy: str = "wait"
    max_inflight: int = 2
    shm_budget: ShmBudget = ShmBudget()
    hold_while_saving: bool = False
    idle_release_s: float = 3600.0
    keep_last: int = 3
    keep_every: int = 0
    write_threads: int = 4
    max_file_bytes: int = 4 * GiB
    link_unchanged: bool = True
    save_timeout_s: float = 600.0
    write_throttle: int = 0
    disk_reserve: int = GiB
    background_nice: int = 0
    background_ionice: str = "off"
    background_cpus: tuple[int, ...] = ()
    log_level: str = "info"
    log_json: bool = False
    node_rank: int = 0
    peers: tuple[str, ...] = ()
    peer_token: str = field(default="", repr=False)
    peer_tls_cert: Path | None = None
    peer_tls_key: Path | None = None
    peer_tls_ca: Path | None = None
    keep_best: int = 0
    best_mode: str = "min"
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    health_port: int = 0
    quantize: str = "none"
    master_weights: str = "keep"
    quant_max_generations: int = 1
    replicas: int = 1
    replica_bandwidth: int = 0
    replica_memory: int = 16 * GiB
    replica_port: int = 0
    replica_prefetch: bool = True
    load_broadcast: str = "auto"
    remote: str = ""
    remote_streams: int = 16
    remote_part_bytes: int = 16 << 20
    remote_keep_last: int = 0
    remote_keep_every: int = 0

    def __post_init__(self) -> None:
        errors = []
        for name, spec in _SPECS.items():
            value = getattr(self, name)
            try:
                parsed = spec.parse(value, False)
            except _Expected as exc:
                errors.append(f"DaemonConfig.{name}={value!r}: expected {exc}")
                continue
            if parsed != value or type(parsed) is not type(value):
                object.__setattr__(self, name, parsed)  # normalize, e.g. "INFO" -> "info", str -> Path
        errors += peer_problems(self.node_rank, self.peers, self.peer_token, (self.peer_tls_cert, self.peer_tls_key, self.peer_tls_ca))
        if errors:
            raise ConfigError("\n".join(errors))

    @property
    def multi_node(self) -> bool:
        return len(self.peers) > 1

    @property
    def peer_tls_files(self) -> tuple[Path, Path, Path] | None:
        """(cert, key, CA) when the peer port uses TLS, else None."""
        if self.peer_tls_cert is None or self.peer_tls_key is None or self.peer_tls_ca is None:
            return None
        return self.peer_tls_cert, self.peer_tls_key, self.peer_tls_ca

    def retention_policy(self) -> RetentionPolicy:
        """The retention rules these settings give (keep_last, keep_every, keep_best, best_mode)."""
        return RetentionPolicy(keep_last=self.keep_last, keep_every=self.keep_every, keep_best=self.keep_best, best_mode=self.best_mode)

    @property
    def background_priority(self) -> BackgroundPriority:
        return BackgroundPriority(self.background_nice, self.background_ionice, self.background_cpus)

    @property
    def peer_address(self) -> str:
        """This daemon's own daemon-to-daemon address (its entry in `peers`)."""
        return self.peers[self.node_rank]


# ------------------------------------------------------------------ parsers
# A parser takes the raw value and whether it is text (a flag or an environment variable, where
# every value is a string) or typed (TOML or Python, where an integer must already be one), and
# returns the value for DaemonConfig or raises _Expected.

Parser = Callable[[Any, bool], Any]


def _path(raw: Any, text: bool) -> Path:
    if isinstance(raw, (str, os.PathLike)) and os.fspath(raw) != "":
        return Path(raw).expanduser()
    raise _Expected("a non-empty path")


def _optional_path(raw: Any, text: bool) -> Path | None:
    """A path, or None when not given (None or an empty string)."""
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return None
    return _path(raw, text)


def _integer(minimum: int, note: str = "") -> Parser:
    expected = f"an integer >= {minimum}{note}"

    def parse(raw: Any, text: bool) -> int:
        if text and isinstance(raw, str):
            try:
                raw = int(raw.strip(), 10)
            except ValueError:
                raise _Expected(expected) from None
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
            raise _Expected(expected)
        return raw

    return parse


def _seconds(raw: Any, text: bool) -> float:
    expected = "a number of seconds > 0"
    if text and isinstance(raw, str):
        try:
            raw = float(raw.strip())
        except ValueError:
            raise _Expected(expected) from None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw <= 0:
        raise _Expected(expected)
    return float(raw)


def _seconds_or_off(raw: Any, text: bool) -> float:
    """Seconds as for _seconds, or 0 (off)."""
    if (type(raw) in (int, float) and raw == 0) or (isinstance(raw, str) and raw.strip() in ("0", "0.0")):
        return 0.0
    try:
        return _seconds(raw, text)
    except _Expected:
        raise _Expected("a number of seconds > 0, or 0 (off)") from None


def _choice(choices: tuple[str, ...]) -> Parser:
    expected = "one of " + ", ".join(repr(c) for c in choices)

    def parse(raw: Any, text: bool) -> str:
        if isinstance(raw, str) and raw.strip().lower() in choices:
            return raw.strip().lower()
        raise _Expected(expected)

    return parse


def _quantize_choices() -> str:
    """The choices of --quantize for messages: "'none' (lossless), 'O1' (int8) or 'O2' (int4)"."""
    words = ["'none' (lossless)"] + [f"'{s.name}' ({s.summary})" for s in builtin_codecs().schemes()]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _quantize(raw: Any, text: bool) -> str:
    """"none" or a registered scheme's name ("O1", "O2"; any case)."""
    schemes = {s.name.lower(): s.name for s in builtin_codecs().schemes()}
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word == "none" or word in schemes:
            return schemes.get(word, "none")
    raise _Expected(_quantize_choices())


def _boolean(raw: Any, text: bool) -> bool:
    if isinstance(raw, bool):
        return raw
    if text and isinstance(raw, str):
        word = raw.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise _Expected("true or false (also 1/0, yes/no, on/off)")
    raise _Expected("true or false")


def _size(raw: Any, text: bool) -> int:
    """Bytes: an integer, or a string such as '4GiB', '512 MiB', '1.5GiB' (binary units only)."""
    expected = "a size in bytes >= 1: an integer, or a number with B, KiB, MiB, GiB or TiB (e.g. '4GiB')"
    if isinstance(raw, str):
        match = _SIZE_PATTERN.fullmatch(raw)
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise _Expected(expected)
        number, unit = match.groups()
        if "." in number and not unit:
            raise _Expected(expected)
        raw = int(float(number) * _SIZE_UNITS[unit.lower()])
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise _Expected(expected)
    return raw


def _size_or_off(raw: Any, text: bool) -> int:
    """A size as for _size, or 0 (off)."""
    if (type(raw) is int and raw == 0) or (isinstance(raw, str) and raw.strip() == "0"):
        return 0
    try:
        return _size(raw, text)
    except _Expected as exc:
        raise _Expected(f"0 (off) or {exc}") from None


def _shm_budget(raw: Any, text: bool) -> ShmBudget:
    """0 (none), a size as for _size, or a share of the host's memory in percent ('50%')."""
    expected = "0 (none), a size in bytes such as '64GiB' (B, KiB, MiB, GiB or TiB), or a share of the host's memory such as '50%'"
    if isinstance(raw, ShmBudget):
        return raw
    if isinstance(raw, str) and raw.strip().endswith("%"):
        try:
            return ShmBudget.of_percent(raw)
        except ValueError as exc:
            raise _Expected(f"{expected}; {exc}") from None
    try:
        return ShmBudget(nbytes=_size_or_off(raw, text))
    except _Expected:
        raise _Expected(expected) from None


def _peers(raw: Any, text: bool) -> tuple[str, ...]:
    """'host:port,host:port,...' (or a TOML list of such strings)."""
    expected = "a comma-separated list of host:port in node-rank order, e.g. 'node0:7070,node1:7070'"
    if isinstance(raw, str):
        raw = [p.strip() for p in raw.split(",")] if raw.strip() else []
    if not isinstance(raw, (list, tuple)) or not all(isinstance(p, str) for p in raw):
        raise _Expected(expected)
    for peer in raw:
        host, sep, port = peer.rpartition(":")
        if not sep or not host or not 0 < (decimal(port) or 0) < 65536:
            raise _Expected(f"{expected}; {peer!r} is not host:port")
    return tuple(raw)


def _priority(parse: Callable[[Any], Any]) -> Parser:
    """A parser of thread_priority's, whose PriorityError says what was expected."""
    def wrapped(raw: Any, text: bool) -> Any:
        try:
            return parse(raw)
        except PriorityError as exc:
            raise _Expected(str(exc)) from None
    return wrapped


def _token(raw: Any, text: bool) -> str:
    if isinstance(raw, str):
        return raw.strip()
    raise _Expected("a string")


@dataclass(frozen=True)
class _Spec:
    parse: Parser
    flag: str
    metavar: str
    help: str


def _port_or_off(raw: Any, text: bool) -> int:
    """A TCP port 1..65535, or 0 (off)."""
    try:
        port = _integer(0)(raw, text)
    except _Expected:
        port = -1
    if not 0 <= port <= 65535:
        raise _Expected("a TCP port between 1 and 65535, or 0 (off)")
    return port


def _port_or_any(raw: Any, text: bool) -> int:
    """A TCP port 1..65535, or 0 (any free port)."""
    try:
        return _port_or_off(raw, text)
    except _Expected:
        raise _Expected("a TCP port between 1 and 65535, or 0 (a free port)") from None


def _remote(raw: Any, text: bool) -> str:
    """"" (none) or s3://BUCKET/PREFIX; remote/location.py checks it."""
    from ckptd.daemon.remote.location import LocationError, location_setting

    try:
        return location_setting(raw)
    except LocationError as exc:
        raise _Expected(f"s3://BUCKET/PREFIX or '' (none): {exc}") from None


def _host(raw: Any, text: bool) -> str:
    """A host name or IP address to listen on (no port, no spaces)."""
    if isinstance(raw, str) and raw.strip() and not any(c.isspace() or c == "/" for c in raw.strip()):
        return raw.strip()
    raise _Expected("a host name or IP address to listen on, e.g. '0.0.0.0' or '127.0.0.1'")


# Every DaemonConfig field, in declaration order (tests/daemon/test_config.py checks they match).
_SPECS: Final[dict[str, _Spec]] = {
    "root": _Spec(_path, "--root", "DIR", "storage root (default: /var/lib/ckptd as root, else $XDG_DATA_HOME/ckptd or ~/.local/share/ckptd)"),
    "socket": _Spec(_path, "--socket", "PATH", "Unix socket for the ranks (default: $XDG_RUNTIME_DIR/ckptd/ckptd.sock, else /run/ckptd/ckptd.sock as root, else /tmp/ckptd-<uid>/ckptd.sock)"),
    "shm_dir": _Spec(_path, "--shm-dir", "DIR", "directory (a tmpfs) for the shared-memory arenas (default: /dev/shm)"),
    "arena_policy": _Spec(_choice(ARENA_POLICIES), "--arena-policy", "{wait,skip}", "when no arena is free: wait (backpressure) or skip the checkpoint (default: wait)"),
    "max_inflight": _Spec(_integer(1), "--max-inflight", "N", "arena sets (snapshots) per job: a second lets a save start while the previous one is written (default: 2)"),
    "shm_budget": _Spec(_shm_budget, "--shm-budget", "SIZE|PERCENT", "shared memory for the arenas of all jobs, e.g. 64GiB or 50%% (of the host's memory); idle snapshots are given back to stay within it; 0 = the --shm-dir's size (default: 0)"),
    "hold_while_saving": _Spec(_boolean, "--hold-while-saving", "", "keep the newest snapshot in memory while the next save fills a second arena set, when --max-inflight and --shm-budget allow (2x memory per job); off: the next save reuses its arenas (default: off)"),
    "idle_release_s": _Spec(_seconds_or_off, "--idle-release", "SECONDS", "give back the shared memory of a job with no save or load for this long; 0 = never (default: 3600)"),
    "keep_last": _Spec(_integer(0, " (0 = keep all)"), "--keep-last", "N", "keep the newest N committed steps; 0 keeps all (default: 3)"),
    "keep_every": _Spec(_integer(0, " (0 = off)"), "--keep-every", "N", "also keep every step divisible by N forever; 0 = off (default: 0)"),
    "write_threads": _Spec(_integer(1), "--write-threads", "N", "threads writing checkpoint files (default: 4)"),
    "max_file_bytes": _Spec(_size, "--max-file-bytes", "SIZE", "split model/optimizer files above this size, e.g. 4GiB (default: 4GiB)"),
    "save_timeout_s": _Spec(_seconds, "--save-timeout", "SECONDS", "seconds all ranks may take to arrive at and commit a snapshot (default: 600)"),
    "link_unchanged": _Spec(_boolean, "--link-unchanged", "", "link files of frozen tensors that did not change since the previous step instead of writing them again (default: on)"),
    "write_throttle": _Spec(_size_or_off, "--write-throttle", "SIZE", "limit writing to SIZE bytes per second, e.g. 50MiB, to simulate a slow disk; 0 = off (default: 0)"),
    "disk_reserve": _Spec(_size_or_off, "--disk-reserve", "SIZE", "keep SIZE free on the storage root's file system: a save that would leave less is refused before writing, e.g. 10GiB; 0 = the files only have to fit (default: 1GiB)"),
    "background_nice": _Spec(_priority(nice_setting), "--background-nice", "N", "run the threads that persist, write, hash, replicate and upload N nice levels below the daemon (at most 19), so a save yields the trainer's cores; 0 = off (default: 0)"),
    "background_ionice": _Spec(_priority(ionice_setting), "--background-ionice", "{best-effort,idle,off}", "IO priority class of those threads: best-effort (its lowest level), idle (disk time only when no one else wants it) or off (default: off)"),
    "background_cpus": _Spec(_priority(cpus_setting), "--background-cpus", "LIST", "run those threads only on these CPUs, e.g. 6-7 or 0,2 (default: unset, any CPU)"),
    "log_level": _Spec(_choice(LOG_LEVELS), "--log-level", "LEVEL", "debug, info, warning, error or critical (default: info)"),
    "log_json": _Spec(_boolean, "--log-json", "", "log one JSON object per line (default: off)"),
    "node_rank": _Spec(_integer(0), "--node-rank", "N", "this node's place in --peers; node 0 coordinates (default: 0)"),
    "peers": _Spec(_peers, "--peers", "HOST:PORT,...", "daemon-to-daemon address of every node in node-rank order; this daemon listens on its own (default: none, a single node)"),
    "peer_token": _Spec(_token, "--peer-token", "TOKEN", "shared secret of the daemons (prefer the environment variable: flags show in ps)"),
    "peer_tls_cert": _Spec(_optional_path, "--peer-tls-cert", "FILE", "PEM certificate of this daemon for mutual TLS on the peer port (with --peer-tls-key and --peer-tls-ca; default: no TLS)"),
    "peer_tls_key": _Spec(_optional_path, "--peer-tls-key", "FILE", "PEM private key of --peer-tls-cert"),
    "peer_tls_ca": _Spec(_optional_path, "--peer-tls-ca", "FILE", "PEM certificate of the CA that signed every daemon's certificate"),
    "keep_best": _Spec(_integer(0, " (0 = off)"), "--keep-best", "N", "also keep the N steps with the best metric given to save(); 0 = off (default: 0)"),
    "best_mode": _Spec(_choice(BEST_MODES), "--best-mode", "{min,max}", "for --keep-best: min = a lower metric is better (a loss), max = higher is better (default: min)"),
    "metrics_port": _Spec(_port_or_off, "--metrics-port", "PORT", "serve Prometheus metrics on http://HOST:PORT/metrics; 0 = off (default: 0)"),
    "metrics_host": _Spec(_host, "--metrics-host", "HOST", "address the metrics and health endpoints listen on (default: 0.0.0.0, every interface)"),
    "health_port": _Spec(_port_or_off, "--health-port", "PORT", "serve gRPC health (grpc.health.v1) on TCP for probes; 0 = off (default: 0)"),
    "quantize": _Spec(
        _quantize, "--quantize", "{" + ",".join(("none", *SCHEMES)) + "}",
        "default compression of optimizer moments for saves that do not choose: "
        + ", ".join(["none"] + [f"{s.name} ({s.summary})" for s in builtin_codecs().schemes()]) + " (default: none)",
    ),
    "master_weights": _Spec(_choice(MASTER_MODES), "--master-weights", "{keep,drop,residual}", "default for fp32 master weights beside bf16 model weights: keep, drop (rebuilt from the model weights) or residual (bf16 difference) (default: keep)"),
    "quant_max_generations": _Spec(_integer(0, " (0 = no limit)"), "--quant-max-generations", "N", "after a resume from a checkpoint N lossy cycles deep, save losslessly; 0 = no limit (default: 1)"),
    "replicas": _Spec(_integer(0, " (0 = off)"), "--replicas", "N", "several nodes: keep each node's newest committed part in the memory of the next N nodes' daemons; 0 = off (default: 1)"),
    "replica_bandwidth": _Spec(_size_or_off, "--replica-bandwidth", "SIZE", "send replicas at most at SIZE bytes per second, e.g. 500MiB; 0 = unlimited (default: 0)"),
    "replica_memory": _Spec(_size, "--replica-memory", "SIZE", "memory (in --shm-dir) for other nodes' replicas; one that does not fit is refused (default: 16GiB)"),
    "replica_port": _Spec(_port_or_any, "--replica-port", "PORT", "TCP port of the bulk channel for replica bytes, on this node's --peers host; 0 = a free port (default: 0)"),
    "replica_prefetch": _Spec(_boolean, "--replica-prefetch", "", "a daemon started on a root that lacks this node's part of a job's newest step (a replaced machine) stages it from the replicas at once, before its ranks ask, held for their load (default: on)"),
    "load_broadcast": _Spec(_choice(LOAD_BROADCAST), "--load-broadcast", "{auto,on,off}", "several nodes: auto = node-local roots: a file several nodes need is read from storage once by its writer, which serves them all; on = also a shared root: a file another node wrote is fetched from that node instead of read from storage (read here when it fails); off = every node reads what it needs (default: auto)"),
    "remote": _Spec(_remote, "--remote", "s3://BUCKET/PREFIX", "upload each committed step to this object store location and restore from it; endpoint and credentials from the AWS environment variables and config files (default: none)"),
    "remote_streams": _Spec(_integer(1), "--remote-streams", "N", "requests in flight to the object store (default: 16)"),
    "remote_part_bytes": _Spec(_size, "--remote-part-bytes", "SIZE", "part size of multipart uploads, at least 5MiB (default: 16MiB)"),
    "remote_keep_last": _Spec(_integer(0, " (0 = keep all)"), "--remote-keep-last", "N", "keep the newest N uploaded steps in the bucket; 0 keeps all (default: 0)"),
    "remote_keep_every": _Spec(_integer(0, " (0 = off)"), "--remote-keep-every", "N", "also keep every step divisible by N in the bucket; 0 = off (default: 0)"),
}


# ------------------------------------------------------------------ loading


def env_name(field: str) -> str:
    """The environment variable of a setting: CKPTD_ + the field name upper-cased."""
    return ENV_PREFIX + field.upper()


@dataclass(frozen=True)
class _Given:
    """One setting as a source gave it, before parsing."""

    value: Any
    where: str  # for messages: "--max-inflight", "CKPTD_MAX_INFLIGHT", "/etc/ckptd.toml: max_inflight"
    text: bool  # a flag or environment string (parsed from text) rather than a typed TOML value
    base_dir: Path | None = None  # relative paths are relative to this (the config file's directory)


def load_config(argv_values: Mapping[str, Any], environ: Mapping[str, str], config_file: Path | None) -> DaemonConfig:
    """Merge the sources: flags > environment > TOML file > defaults, and validate.

    argv_values: field name -> value of the flags the user gave (a value of None = not given);
        strings are parsed as on the command line.
    environ: the environment; CKPTD_<FIELD> variables are read, empty ones count as unset.
    config_file: the TOML file; None = $CKPTD_CONFIG if set, else no file.
    Raises ConfigError naming every bad setting and where it came from.
    """
    unknown = sorted(set(argv_values) - set(_SPECS))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; valid ones are {', '.join(_SPECS)}")
    if config_file is None and environ.get(CONFIG_ENV):
        config_file = Path(environ[CONFIG_ENV]).expanduser()

    given: dict[str, _Given] = {}  # later sources override earlier ones
    if config_file is not None:
        given.update(_read_file(config_file))
    for name in _SPECS:
        if environ.get(env_name(name)):
            given[name] = _Given(environ[env_name(name)], env_name(name), text=True)
    for name, value in argv_values.items():
        if value is not None:
            given[name] = _Given(value, _SPECS[name].flag, text=True)

    values: dict[str, Any] = {}
    errors = []
    for name in _SPECS:
        g = given.get(name)
        if g is None:
            continue
        try:
            value = _SPECS[name].parse(g.value, g.text)
        except _Expected as exc:
            errors.append(f"{g.where}={g.value!r}: expected {exc}")
            continue
        if isinstance(value, Path) and g.base_dir is not None and not value.is_absolute():
            value = g.base_dir / value
        values[name] = value
    if errors:
        raise ConfigError("\n".join(errors))
    values.setdefault("root", default_root(environ))
    values.setdefault("socket", default_socket(environ))
    return DaemonConfig(**values)


def _read_file(path: Path) -> dict[str, _Given]:
    """The settings a TOML file gives, by field name."""
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check --config / ${CONFIG_ENV}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None

    found: dict[str, _Given] = {}
    for key, value in doc.items():
        if key == RETENTION_TABLE:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {key!r} must be a table ([{key}]) with keys {', '.join(RETENTION_KEYS)}")
            for sub, sub_value in value.items():
                if sub not in RETENTION_KEYS:
                    raise ConfigError(
                        f"{path}: unknown key {sub!r} in [{key}]; valid keys there are {', '.join(RETENTION_KEYS)}"
                    )
                if sub in doc:
                    raise ConfigError(f"{path}: {sub} is set both at the top level and in [{key}]; keep one")
                found[sub] = _Given(sub_value, f"{path}: {key}.{sub}", text=False)
        elif key in _SPECS:
            found[key] = _Given(value, f"{path}: {key}", text=False, base_dir=path.parent)
        else:
            raise ConfigError(
                f"{path}: unknown key {key!r}; valid keys are {', '.join(_SPECS)}, "
                f"and the table [{RETENTION_TABLE}] with {', '.join(RETENTION_KEYS)}"
            )
    return found


# ------------------------------------------------------------------ command line


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ckptd serve` flags. All default to None (= not given) so the environment and file can apply."""
    parser.add_argument("--config", default=None, metavar="FILE", help=f"TOML config file (default: ${CONFIG_ENV}, else none)")
    for name, spec in _SPECS.items():
        where = f" [env {env_name(name)}]"
        if spec.parse is _boolean:
            parser.add_argument(spec.flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=spec.help + where)
        else:
            parser.add_argument(spec.flag, dest=name, default=None, metavar=spec.metavar, help=spec.help + where)


def config_from_args(ns: argparse.Namespace, environ: Mapping[str, str]) -> DaemonConfig:
    """The config for parsed `ckptd serve` arguments (see add_serve_arguments) and an environment."""
    given = {name: getattr(ns, name, None) for name in _SPECS}
    config = getattr(ns, "config", None)
    return load_config(given, environ, Path(config).expanduser() if config else None)
