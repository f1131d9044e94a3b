"""What the object-store tier reports: its counters (for `ckptd status`) and its Prometheus
series, registered on the daemon's own registry (metrics.Metrics.registry). Every series is
listed in docs/operations.md (Metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

# Why an upload attempt failed (label `reason` of ckptd_remote_upload_failures_total).
FAILURE_REASONS = (
    "unavailable",  # the object store did not answer or failed (retried with backoff)
    "access",  # the credentials were refused (fix them; retried meanwhile)
    "bucket",  # the bucket does not exist (create it; retried meanwhile)
    "waiting",  # node 0 waited too long for the other nodes' files (retried)
    "local",  # a file of the step on this node does not match its index: the step is not uploaded
    "internal",  # a bug: see the daemon's log
)


@dataclass
class TierCounters:
    """Since the daemon started. Updated on the event loop only."""

    uploaded_steps: int = 0
    uploaded_bytes: int = 0
    copied_bytes: int = 0
    failures: int = 0
    restored_steps: int = 0
    restored_bytes: int = 0
    last_uploaded: str = ""
    last_error: str = ""
    # for `ckptd status --job`: each job's newest upload, and the newest failure of each job
    # (None: of no one job, e.g. the store unreachable at start: every job's), oldest first
    job_uploaded: dict[str, str] = field(default_factory=dict)
    job_errors: dict[str | None, str] = field(default_factory=dict)


class TierMetrics:
    """The tier's series. `pending` and `lag` are read at scrape time (from the HTTP thread: they
    only read numbers the loop keeps up to date)."""

    def __init__(self, registry: CollectorRegistry, pending: Callable[[], float], lag: Callable[[], float]) -> None:
        r = registry
        self.uploaded_steps = Counter("ckptd_remote_uploaded_steps", "Steps this daemon made visible in the object store (its index written).", ["job"], registry=r)
        self.uploaded_bytes = Counter("ckptd_remote_uploaded_bytes", "Bytes of checkpoint files this daemon sent to the object store.", ["job"], registry=r)
        self.copied_bytes = Counter(
            "ckptd_remote_copied_bytes", "Bytes of files copied inside the bucket instead of uploaded (unchanged since an earlier uploaded step).",
            ["job"], registry=r,
        )
        self.failures = Counter("ckptd_remote_upload_failures", "Failed upload attempts, by reason (see docs/operations.md).", ["reason"], registry=r)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        self.restored_steps = Counter("ckptd_remote_restored_steps", "Steps downloaded from the object store into the local root.", ["job"], registry=r)
        self.restored_bytes = Counter("ckptd_remote_restored_bytes", "Bytes downloaded from the object store into the local root.", ["job"], registry=r)
        self.deleted_steps = Counter("ckptd_remote_retention_deleted_steps", "Steps deleted from the bucket by its retention (--remote-keep-last).", ["job"], registry=r)
        pending_gauge = Gauge("ckptd_remote_pending_steps", "Committed steps of this node not uploaded yet (being uploaded included).", registry=r)
        pending_gauge.set_function(pending)
        lag_gauge = Gauge(
            "ckptd_remote_lag_seconds", "Seconds since the commit of the oldest step of this node not uploaded yet; 0 when every step is uploaded.",
            registry=r,
        )
        lag_gauge.set_function(lag)
