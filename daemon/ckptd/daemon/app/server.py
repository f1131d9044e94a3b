"""`ckptd serve`: the grpc.aio server on a Unix socket, health service, graceful shutdown.

Both gRPC servers (Checkpoint on the socket, Peer on TCP) map domain errors to status codes in
one interceptor (rpc_errors.ErrorStatusInterceptor); the Peer server also checks the peer token
in one (rpc_auth.PeerTokenInterceptor).

SIGTERM/SIGINT: stop taking new saves (readiness health NOT_SERVING on every server, `liveness`
SERVING until the process exits; BeginSave UNAVAILABLE), let open snapshots complete and
everything handed over be committed, then exit 0.
SIGHUP: read the configuration again (same flags, environment and file) and apply what can
change while serving (CheckpointService.reconfigure); a bad file keeps the old settings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket as socket_module
import stat
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.handoff.shm_dir import check_shm
from ckptd.daemon.heap import quiet_collector
from ckptd.daemon.metrics import read_on_loop
from ckptd.daemon.plan.files import VERSION
from ckptd.daemon.private_dirs import files_dir, prepare_socket_dir
from ckptd.daemon.rpc.auth import PeerTokenInterceptor
from ckptd.daemon.rpc.checkpoint import CheckpointServicer
from ckptd.daemon.rpc.errors import ErrorStatusInterceptor
from ckptd.daemon.rpc.peer import PeerServicer
from ckptd.daemon.service import CheckpointService
from ckptd.daemon.storage.fs import make_dir
from ckptd.wire import MESSAGE_SIZE_OPTIONS
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 60.0
SERVICE_NAME = "ckptd.v1.Checkpoint"
PEER_SERVICE_NAME = "ckptd.v1.Peer"
LIVENESS = "liveness"  # health service name that stays SERVING while the process runs (drain included)
SHM_WARN_BYTES = 1 << 30


class SocketInUse(RuntimeError):
    """Another daemon already answers on the socket."""


def _prepare_socket(path: Path) -> None:
    """The socket's directory made or checked (private_dirs.prepare_socket_dir: only this
    daemon's user can change it), and a socket left there by a daemon that died removed;
    SocketInUse when something else is at the path or a daemon answers on it."""
    prepare_socket_dir(path.parent)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUse(f"{path} exists and is not a socket; choose another --socket path")
        probe = socket_module.socket(socket_module.AF_UNIX)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            try:
                path.unlink()  # left by a daemon that died
            except PermissionError:
                raise SocketInUse(f"{path} is a socket of uid {path.lstat().st_uid} that this daemon cannot remove; remove it (its owner or root) or choose another --socket") from None
        else:
            raise SocketInUse(f"another daemon is listening on {path}; stop it or choose another --socket")
        finally:
            probe.close()


MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")  # what --shm-dir should be on: files that live in memory


def mount_of(path: Path) -> tuple[str, str]:
    """(type, mount options) of the file system holding `path` (("", "") if unknown), from /proc/mounts."""
    best, found = "", ("", "")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return found
    target = str(path.resolve())
    for line in lines:
        fields = line.split()
        if len(fields) >= 4 and (target == fields[1] or target.startswith(fields[1].rstrip("/") + "/")) and len(fields[1]) > len(best):
            best, found = fields[1], (fields[2], fields[3])
    return found


def shm_dir_notice(kind: str, options: str) -> tuple[int, str] | None:
    """What the start-up log says of a shared-memory directory on a file system of type `kind`
    mounted with `options` (mount_of; "" unknown): (logging level, message with one %s for the
    directory), or None."""
    if kind and kind not in MEMORY_FILE_SYSTEMS:
        return logging.WARNING, (
            f"shared-memory directory %s is on {kind.replace('%', '%%')}, not a file system in memory: every snapshot goes to that disk before "
            "it is written to the root; point --shm-dir at a tmpfs such as /dev/shm"
        )
    if "huge=always" not in options:
        return logging.INFO, (
            "arenas in %s use 4 KiB pages; a tmpfs mounted with huge=always makes restores into a "
            "restarted trainer about 2x faster (docs/operations.md: The daemon, shared memory)"
        )
    return None


async def serve(config: DaemonConfig, reload: Callable[[], DaemonConfig] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the process exit code.

    reload: reads the configuration again on SIGHUP (None: SIGHUP is ignored, with a warning)."""
    if len(str(config.socket)) > 100:
        raise ValueError(f"socket path {config.socket} is longer than the 100 characters a Unix socket allows; use a shorter path")
    if config.shm_dir.parent.is_dir() and not os.path.lexists(config.shm_dir):
        make_dir(config.shm_dir, exist_ok=True)
    problem = check_shm(config.shm_dir, 0)
    if problem:
        raise RuntimeError(problem)
    # The daemon's files in shared memory go where no other user can plant or swap them.
    configured, config = config.shm_dir, replace(config, shm_dir=files_dir(config.shm_dir))
    if config.shm_dir != configured:
        log.info("shared-memory files in %s: %s is shared with other users", config.shm_dir, configured)
        reload = _keeping_shm_dir(reload, configured, config.shm_dir)
    # A container's default 64 MiB /dev/shm fails every real save: say so now, not at the first save.
    small = check_shm(config.shm_dir, SHM_WARN_BYTES)
    if small:
        log.warning("%s", small)
    notice = shm_dir_notice(*mount_of(config.shm_dir))
    if notice is not None:
        log.log(notice[0], notice[1], config.shm_dir)
    _prepare_socket(config.socket)
    faults = None
    if os.environ.get("CKPTD_FAULT_KILL_AT") or os.environ.get("CKPTD_FAULT_LOG"):  # tests only (faults.py)
        from ckptd.daemon.faults.files import install_from_env

        faults = install_from_env(os.environ, config.root)
        log.warning("fault injection is on (%s): this daemon is for tests only", ", ".join(k for k in os.environ if k.startswith("CKPTD_FAULT_")))
    service = CheckpointService(config)
    await asyncio.to_thread(service.start)
    await service.start_remote()  # before retention: steps not uploaded yet are kept
    await service.retention_at_start()
    if config.metrics_port:
        service.metrics.watch(read_on_loop(asyncio.get_running_loop(), service.live_state))
        service.metrics.info.labels(VERSION, str(config.node_rank)).set(1)
        try:
            service.metrics.serve(config.metrics_host, config.metrics_port)
        except OSError as exc:
            raise RuntimeError(
                f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc.strerror or exc}; "
                "choose a free --metrics-port (or 0 to turn the endpoint off)"
            ) from None

    server = grpc.aio.server(options=list(MESSAGE_SIZE_OPTIONS), interceptors=[ErrorStatusInterceptor()])
    pb_grpc.add_CheckpointServicer_to_server(CheckpointServicer(service, service.gpu), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"unix://{config.socket}"
    server.add_insecure_port(address)
    peer_server, peer_health = _peer_server(config, service) if service.cluster is not None else (None, None)
    # The bulk port after the --peers port is bound: with --replica-port 0 the kernel picks its
    # port, and could otherwise pick the one --peers names for this node.
    service.start_replication()
    probe_server = _probe_server(config, health_servicer) if config.health_port else None
    await server.start()
    if probe_server is not None:
        await probe_server.start()
    background = [asyncio.get_running_loop().create_task(service.release_idle_arenas())]
    if peer_server is not None:
        await peer_server.start()
        log.info("node %s of %s: peer service on %s", config.node_rank, len(config.peers), config.peer_address)
        if config.node_rank != 0:  # parts written before a restart: committed by node 0 or not?
            background.append(asyncio.get_running_loop().create_task(service.resolve_prepared()))
            background.append(asyncio.get_running_loop().create_task(service.member_retention_at_start()))
            background.append(asyncio.get_running_loop().create_task(service.prefetch_parts()))
    os.chmod(config.socket, 0o660)
    for name in ("", SERVICE_NAME, LIVENESS):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if peer_health is not None:
        for name in ("", PEER_SERVICE_NAME):
            await peer_health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("ckptd serving on %s, root %s, shared memory in %s", address, config.root, config.shm_dir)
    if faults is not None:
        faults.arm()  # file events are counted from here on: those of start-up recovery are not

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: background.append(loop.create_task(_reload(service, reload))))
    await stop.wait()

    log.info("shutting down: no new saves; committing what is in flight")
    # Not enter_graceful_shutdown() here: it would take LIVENESS down too, and a probe would then
    # kill a daemon that is still committing (LIVENESS stays SERVING until the process exits).
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if peer_health is not None:
        await peer_health.enter_graceful_shutdown()  # every name it serves, for good
    for task in background:
        task.cancel()
    started = time.monotonic()
    await service.drain(DRAIN_GRACE_S)
    log.info("drained in %.1f s; stopping the servers", time.monotonic() - started)
    await server.stop(grace=2.0)
    if peer_server is not None:
        await peer_server.stop(grace=2.0)
    if probe_server is not None:
        await probe_server.stop(grace=1.0)
    if service.cluster is not None:
        await service.cluster.close()
    await service.close_remote()
    await asyncio.to_thread(service.close)
    service.metrics.close()
    try:
        config.socket.unlink()
    except FileNotFoundError:
        pass
    log.info("ckptd stopped")
    return 0


def _keeping_shm_dir(reload: Callable[[], DaemonConfig] | None, configured: Path, used: Path) -> Callable[[], DaemonConfig] | None:
    """`reload` whose configuration names the shared-memory directory in use (files_dir) where
    it still names the configured one: SIGHUP does not report an unchanged --shm-dir as changed."""
    if reload is None:
        return None
    read = reload

    def again() -> DaemonConfig:
        new = read()
        return replace(new, shm_dir=used) if new.shm_dir == configured else new

    return again


async def _reload(service: CheckpointService, reload: Callable[[], DaemonConfig] | None) -> None:
    """SIGHUP: apply the settings that can change while serving; log what needs a restart."""
    from ckptd.daemon.config import ConfigError

    if reload is None:
        log.warning("SIGHUP: this daemon was started without a way to re-read its configuration; ignored")
        return
    try:
        new = await asyncio.to_thread(reload)
    except (ConfigError, OSError) as exc:
        log.error("SIGHUP: configuration not reloaded, the old settings stay: %s", exc)
        return
    logging.getLogger().setLevel(new.log_level.upper())
    fixed = service.reconfigure(new)
    log.info(
        "SIGHUP: configuration reloaded (retention keep_last=%s keep_every=%s keep_best=%s best_mode=%s)",
        new.keep_last, new.keep_every, new.keep_best, new.best_mode,
    )
    if fixed:
        log.warning("SIGHUP: %s changed but only take effect after a restart (systemctl restart ckptd)", ", ".join(fixed))


def _probe_server(config: DaemonConfig, health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """gRPC health on TCP (--health-port) for probes; the same statuses as on the Unix socket."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.metrics_host}:{config.health_port}"
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot listen on {address} for health probes (--health-port): is the port in use?")
    log.info("gRPC health for probes on %s", address)
    return server


def _peer_server(config: DaemonConfig, service: CheckpointService) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The daemon-to-daemon server on this node's --peers entry (TCP): the Peer service (every
    call checked for the peer token) and health, nothing else (the Checkpoint service stays on
    the Unix socket); and that health servicer, which drain sets NOT_SERVING."""
    server = grpc.aio.server(
        options=[*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)],
        interceptors=[ErrorStatusInterceptor(), PeerTokenInterceptor(config.peer_token)],  # errors outermost: it maps the token's
    )
    ppb_grpc.add_PeerServicer_to_server(PeerServicer(service), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    assert service.cluster is not None
    tls = service.cluster.links.tls
    if tls is None:
        bound = server.add_insecure_port(config.peer_address)
    else:
        bound = server.add_secure_port(config.peer_address, tls.server_credentials())
    if bound == 0:
        raise RuntimeError(f"cannot listen on {config.peer_address} (this node's --peers entry): is the port in use or the host not this machine's?")
    return server, health_servicer


def run(config: DaemonConfig, reload: Callable[[], DaemonConfig] | None = None) -> int:
    """Run `serve` on uvloop when available, in this process, with its garbage collector made
    quiet (heap.quiet_collector). reload: re-reads the configuration on SIGHUP."""
    quiet_collector()
    try:
        import uvloop
    except ImportError:  # uvloop is not available on every platform; asyncio's loop works too
        return asyncio.run(serve(config, reload))
    return uvloop.run(serve(config, reload))
