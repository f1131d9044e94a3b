"""What one save stores lossily: decided once, when the save is planned, from the ranks' options,
the daemon's defaults and the lineage (the compounding guard). Pure.

A single node decides when it plans the save; with several nodes, node 0 decides for all when
every node has joined (Coordinator.join), and each node writes its part with that decision: the
writer decides nothing itself (`PersistRequest.quantize`, `.master_weights`, `.quantization`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ckptd.daemon.plan.retention import JobRetention


@dataclass(frozen=True)
class SaveOptions:
    """What compression (and job retention) a rank asks for; every rank of a save (on every node) must ask for the same."""

    quantize: str | None = None  # None: the daemon's default
    master_weights: str | None = None  # None: the daemon's default
    no_quantize: bool = False
    retention: JobRetention | None = None  # the job's own retention (retention.merge); None: the daemon's

    def describe(self) -> str:
        """The options as an error message names them."""
        return f"quantize={self.quantize!r}, master_weights={self.master_weights!r}" + (f", {self.retention}" if self.retention else "")


NO_OPTIONS = SaveOptions()


@dataclass(frozen=True)
class Compression:
    """The compression of one save."""

    quantize: str | None  # scheme name, None: optimizer state stored as is
    master_weights: str  # "keep" | "drop" | "residual"
    generation: int  # lossy cycles in the values' history, this save included
    recorded: bool  # the index records it (else: lossless, no lossy ancestor)
    capped: bool = False  # lossless because the lineage reached the limit (worth a log line)

    @property
    def record(self) -> dict[str, Any] | None:
        """The index's `quantization` record (None: nothing to record)."""
        if not self.recorded:
            return None
        return {"generation": self.generation, "quantize": self.quantize, "master_weights": self.master_weights}


def decide_compression(
    options: SaveOptions, lineage: int, default_quantize: str, default_master: str, max_generations: int
) -> Compression:
    """The ranks' options, else the daemon's defaults ("none": no quantization); lossless (and
    master weights kept) once `lineage` (lossy cycles behind the values being saved) reaches
    `max_generations` (0: no limit), so that error does not pile up over repeated resumes."""
    scheme = None if options.no_quantize else options.quantize or (None if default_quantize == "none" else default_quantize)
    master = options.master_weights or default_master
    capped = bool(max_generations and lineage >= max_generations and (scheme is not None or master == "drop"))
    if capped:
        scheme = None
        master = "keep" if master == "drop" else master
    generation = lineage + (1 if scheme is not None or master == "drop" else 0)
    recorded = bool(generation or scheme is not None or master != "keep")
    return Compression(scheme, master, generation, recorded, capped)


Decide = Callable[[SaveOptions, int], Compression]  # (options, lineage) -> the save's compression


def lossless_by_default(options: SaveOptions, lineage: int) -> Compression:
    """The decision under the daemon's default settings (no quantization unless asked, master
    weights kept, one lossy generation at most)."""
    return decide_compression(options, lineage, "none", "keep", 1)
