"""The declared layers of ckptd, top to bottom (docs/architecture.md §1): a module may import
only modules of its own layer or of layers below it. A module belongs to the layer of the
longest prefix that names it. tests/test_hygiene.py enforces the order (counting imports under
`if TYPE_CHECKING:`); tools/arch_metrics.py reports against it.

The rpc package is two floors: its servicers (`rpc.checkpoint`, `rpc.peer`) serve the tiers and
the engine, while the rest of it (conversion, validation, error mapping, authentication, TLS,
the peer links and the peer client) is what the tiers themselves call other nodes with.
"""

LAYERS: list[tuple[str, ...]] = [
    # the client root: integrations and the offline reader use the client, never the daemon
    ("ckptd.integrations", "ckptd.offline", "ckptd.demo"),
    ("ckptd.client",),
    ("ckptd.format",),  # the on-disk format, pure: the daemon writes it, the client and the tools read it
    ("ckptd.common", "ckptd.wire"),
]

DAEMON_LAYERS: list[tuple[str, ...]] = [
    ("ckptd.daemon.app",),  # the process: server, CLI
    ("ckptd.daemon.rpc.checkpoint", "ckptd.daemon.rpc.peer"),  # servicers: validate, call the service, convert
    ("ckptd.daemon.service",),  # the composition root and the facade the servicers call
    ("ckptd.daemon.tools", "ckptd.daemon.importer"),
    ("ckptd.daemon.tiers", "ckptd.daemon.remote"),
    ("ckptd.daemon.rpc",),  # conversion, validation, errors, auth, TLS, peer links and client
    ("ckptd.daemon.engine",),
    ("ckptd.daemon.config", "ckptd.daemon.records", "ckptd.daemon.metrics", "ckptd.daemon.peer_settings"),  # settings, the engine's typed results
    ("ckptd.daemon.write",),
    ("ckptd.daemon.handoff",),
    ("ckptd.daemon.plan",),
    ("ckptd.daemon.storage", "ckptd.daemon.private_dirs", "ckptd.daemon.thread_priority", "ckptd.daemon.heap"),  # heap: the process's malloc and garbage collector
    ("ckptd.daemon.remote.location",),
    ("ckptd.daemon.errors", "ckptd.daemon.faults", "ckptd.daemon.memo"),  # memo: a cache of values derived from objects, by identity
]
