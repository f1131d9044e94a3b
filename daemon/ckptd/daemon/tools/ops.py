"""Operator commands: `ckptd status`, `ckptd gc`, `ckptd verify`, `ckptd ls`.

Human-readable output by default, `--json` for scripts (one JSON document on stdout). Exit
codes: 0 = fine, 1 = a problem was found or the daemon did not answer, 2 = bad input.
`status` and `gc` talk to a running daemon (--address, else $CKPTD_ADDRESS, else the default
socket); `verify` and `ls` read the storage root directly and work with the daemon stopped
(`ls` without a root asks the running daemon for its root).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, TypeVar

import grpc

from ckptd.common.names import decimal
from ckptd.common.paths import daemon_address, default_address
from ckptd.common.sizes import human_bytes
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError, parse_step_dir_name
from ckptd.daemon.plan.rollback import rollbacks
from ckptd.daemon.storage import Storage, is_job_dir, is_storage_root
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ckptd.daemon.tools.verify import VerifyReport

RPC_TIMEOUT_S = 30.0
BAR_WIDTH = 24
T = TypeVar("T")


def human_seconds(s: float) -> str:
    """75 -> '1m15s'."""
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d{h}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """'[#########...............]  37%'; an unknown total shows an empty bar."""
    frac = min(1.0, done / total) if total > 0 else 0.0
    filled = int(round(frac * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:3.0f}%"


def _address(args: argparse.Namespace, what: str) -> str:
    """The daemon's address: --address, else $CKPTD_ADDRESS, else the default socket
    (paths.daemon_address: a socket's bare path is taken too); exit 1 saying what to write."""
    try:
        return daemon_address(args.address) if args.address else default_address()
    except ValueError as exc:
        _fail(f"ckptd {what}: {exc}")
    raise AssertionError("unreachable")


def _call(address: str, what: str, fn: Callable[[pb_grpc.CheckpointStub], T]) -> T:
    """Call the daemon at `address`; on failure print what to check and exit 1."""
    target = address[len("unix://") :] if address.startswith("unix://") else None
    if target is not None and not Path(target).exists():
        _fail(
            f"ckptd {what}: no daemon socket at {target}; is the daemon running (`systemctl status ckptd`, "
            "`kubectl -n ckptd get pods`)? Point --address or CKPTD_ADDRESS at its socket (unix:///run/ckptd/ckptd.sock)"
        )
    try:
        with grpc.insecure_channel(address) as channel:
            return fn(pb_grpc.CheckpointStub(channel))
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.UNAVAILABLE:
            _fail(f"ckptd {what}: no daemon answers at {address} ({exc.details()}); start it (`ckptd serve`, `systemctl start ckptd`) or fix --address / CKPTD_ADDRESS")  # type: ignore[attr-defined]
        _fail(f"ckptd {what}: the daemon at {address} answered {code.name}: {exc.details()}")  # type: ignore[attr-defined]
    raise AssertionError("unreachable")


def _fail(message: str, code: int = 1) -> NoReturn:
    print(message, file=sys.stderr)
    raise SystemExit(code)


# ------------------------------------------------------------------ status


def status_doc(reply: pb.StatusResponse, address: str) -> dict[str, Any]:
    """The status as a JSON-able dict (the --json output; stable keys)."""
    last = None
    if reply.HasField("last_commit"):
        c = reply.last_commit
        last = {"job": c.job, "step": c.step, "committed_at": c.committed_at, "latency_s": c.latency_s, "bytes": c.bytes, "step_dir": c.step_dir}
    return {
        "address": address,
        "version": reply.version,
        "root": reply.root,
        "node_rank": reply.node_rank,
        "nodes": reply.nodes,
        "uptime_s": reply.uptime_s,
        "draining": reply.draining,
        "queue_depth": reply.queue_depth,
        "arena_bytes": reply.arena_bytes,
        "arena_count": reply.arena_count,
        "shm_budget": reply.shm_budget,
        "shm_free": reply.shm_free,
        "shm_staging": reply.shm_staging,
        "arena_holders": [
            {"job": h.job, "bytes": h.bytes, "sets": h.sets, "held_steps": list(h.held_steps), "in_flight": h.in_flight,
             "readers": h.readers, "idle_s": h.idle_s}
            for h in reply.arena_holders
        ],
        "loads_active": reply.loads_active,
        "committed_total": reply.committed_total,
        "failed_total": reply.failed_total,
        "skipped_total": reply.skipped_total,
        "bytes_written_total": reply.bytes_written_total,
        "link_mismatches_total": reply.link_mismatches_total,
        "last_commit": last,
        "last_error": reply.last_error,
        "remote": {f.name: getattr(reply.remote, f.name) for f in reply.remote.DESCRIPTOR.fields} if reply.HasField("remote") else None,
        "replicas": _replicas_doc(reply.replicas) if reply.HasField("replicas") else None,
        "in_flight": [
            {
                "job": f.job, "step": f.step, "state": f.state, "bytes_total": f.bytes_total, "bytes_written": f.bytes_written, "bytes_linked": f.bytes_linked,
                "age_s": f.age_s, "ranks_arrived": f.ranks_arrived, "ranks_expected": f.ranks_expected, "write_s": f.write_s,
            }
            for f in reply.in_flight
        ],
    }


def _replicas_doc(r: pb.ReplicaStatus) -> dict[str, Any]:
    return {
        "held_bytes": r.held_bytes,
        "memory_limit": r.memory_limit,
        "held": [{"job": h.job, "node": h.node, "step": h.step, "bytes": h.bytes} for h in r.held],
        "jobs": [
            {"job": j.job, "pushed_step": j.pushed_step, "holders": list(j.holders), "push_error": j.push_error, "pushing": j.pushing,
             "recoverable_step": j.recoverable_step, "not_recoverable": j.not_recoverable}
            for j in r.jobs
        ],
        "bulk_port": {
            "port": r.bulk_port.port, "healthy": r.bulk_port.healthy, "problem": r.bulk_port.problem, "accept_errors": r.bulk_port.accept_errors,
            "refused": r.bulk_port.refused, "opening": r.bulk_port.opening,
        } if r.HasField("bulk_port") else None,
    }


def _replica_lines(replicas: dict[str, Any]) -> list[str]:
    """`ckptd status` lines of the replica tiers: what this node holds for others, where its parts are held,
    and (node 0) which step each job can recover from memory."""
    held = ", ".join(f"node {h['node']}'s step {h['step']} of {h['job']} ({human_bytes(h['bytes'])})" for h in replicas["held"])
    lines = [f"replicas held for other nodes: {human_bytes(replicas['held_bytes'])} of {human_bytes(replicas['memory_limit'])}" + (f": {held}" if held else "")]
    for j in replicas["jobs"]:
        parts = []
        if j["pushed_step"] >= 0:
            where = "being sent" if j["pushing"] else f"held by nodes {j['holders']}" if j["holders"] else "held by no other node"
            parts.append(f"this node's part of step {j['pushed_step']} {where}" + (f" ({j['push_error']})" if j["push_error"] else ""))
        if j["recoverable_step"] >= 0:
            parts.append(f"recoverable from memory: step {j['recoverable_step']}")
        if j["not_recoverable"]:
            parts.append(f"not recoverable: {j['not_recoverable']}")
        lines.append(f"  job {j['job']}: " + "; ".join(parts))
    port = replicas.get("bulk_port")
    if port is not None:
        refused = f"; {port['refused']} connections refused without a valid ticket" if port["refused"] else ""
        lines.append(f"  bulk port {port['port']}: " + ("healthy" if port["healthy"] else f"UNHEALTHY: {port['problem']}") + refused)
    return lines


def _holder_lines(doc: dict[str, Any]) -> list[str]:
    """`ckptd status` lines of who holds the arenas' shared memory: per job, bytes, steps, idle time."""
    lines = []
    for h in doc.get("arena_holders", []):
        parts = [f"{human_bytes(h['bytes'])} in {h['sets']} arena set(s)"]
        if h["held_steps"]:
            parts.append("holds step " + ", ".join(map(str, h["held_steps"])) + " for restores from memory")
        if h["in_flight"]:
            parts.append(f"{h['in_flight']} save(s) in flight")
        if h["readers"]:
            parts.append(f"read by {h['readers']} load(s)")
        parts.append(f"idle {human_seconds(h['idle_s'])}" if h["idle_s"] > 0 else "in use")
        lines.append(f"  job {h['job']}: " + "; ".join(parts))
    return lines


def render_status(doc: dict[str, Any], now: float) -> str:
    budget = human_bytes(doc["shm_budget"]) if doc.get("shm_budget") else "none"
    lines = [
        f"ckptd {doc['version']} at {doc['address']} (node {doc['node_rank']} of {doc['nodes']}), root {doc['root']}, "
        f"up {human_seconds(doc['uptime_s'])}" + (", DRAINING (shutting down, no new saves)" if doc["draining"] else ""),
        f"arenas: {doc['arena_count']} holding {human_bytes(doc['arena_bytes'])} of shared memory (budget {budget}, "
        f"{human_bytes(doc.get('shm_free', 0))} free)" + (f"; loads' staging files {human_bytes(doc['shm_staging'])}" if doc.get("shm_staging") else "")
        + f"; queue depth {doc['queue_depth']}; loads in progress {doc['loads_active']}",
        *_holder_lines(doc),
        f"since start: {doc['committed_total']} committed, {doc['failed_total']} failed, {doc['skipped_total']} skipped; "
        f"{human_bytes(doc['bytes_written_total'])} written"
        + (f"; {doc['link_mismatches_total']} linked files found damaged and written again (see the log)" if doc["link_mismatches_total"] else ""),
    ]
    last = doc["last_commit"]
    if last:
        lines.append(
            f"last commit: job {last['job']} step {last['step']}, {human_seconds(max(0.0, now - last['committed_at']))} ago, "
            f"{human_bytes(last['bytes'])}, durable {last['latency_s']:.2f} s after the snapshot ({last['step_dir']})"
        )
    else:
        lines.append("last commit: none since the daemon started")
    if doc["last_error"]:
        lines.append(f"last error: {doc['last_error']}")
    remote = doc.get("remote")
    if remote:
        lag = f", lag {human_seconds(remote['lag_s'])}" if remote["pending_steps"] else ""
        lines.append(
            f"object store: {remote['location']} at {remote['endpoint']}, {remote['state']}; {remote['uploaded_steps']} steps uploaded "
            f"({human_bytes(remote['uploaded_bytes'])} sent, {human_bytes(remote['copied_bytes'])} copied in the bucket), "
            f"{remote['pending_steps']} pending{lag}, {remote['failures']} failed attempts; {remote['restored_steps']} steps restored"
            + (f"; last: {remote['last_uploaded']}" if remote["last_uploaded"] else "")
        )
        if remote["last_error"]:
            lines.append(f"object store last error: {remote['last_error']}")
    if doc.get("replicas"):
        lines += _replica_lines(doc["replicas"])
    if not doc["in_flight"]:
        lines.append("no checkpoint in flight")
        return "\n".join(lines)
    lines.append("")
    lines.append(f"{'JOB':<20} {'STEP':>10}  {'STATE':<12} {'PROGRESS':<{BAR_WIDTH + 7}} {'WRITTEN / TOTAL':<23} {'RATE':>12}  AGE")
    for f in doc["in_flight"]:
        if f["state"] == "writing":
            rate = f"{human_bytes(f['bytes_written'] / f['write_s'])}/s" if f["write_s"] > 0 else "-"
            bar = progress_bar(f["bytes_written"] + f["bytes_linked"], f["bytes_total"])
        else:  # gathering ranks or copying into the arenas: progress = ranks done
            rate = f"ranks {f['ranks_arrived']}/{f['ranks_expected']}"
            bar = progress_bar(f["ranks_arrived"], f["ranks_expected"])
        amount = f"{human_bytes(f['bytes_written'])} / {human_bytes(f['bytes_total'])}" + (f" (+{human_bytes(f['bytes_linked'])} linked)" if f["bytes_linked"] else "")
        lines.append(f"{f['job']:<20} {f['step']:>10}  {f['state']:<12} {bar:<{BAR_WIDTH + 7}} {amount:<23} {rate:>12}  {human_seconds(f['age_s'])}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    address = _address(args, "status")
    request = pb.StatusRequest(job=args.job or "")
    while True:
        reply = _call(address, "status", lambda stub: stub.Status(request, timeout=RPC_TIMEOUT_S))
        doc = status_doc(reply, address)
        if args.json:
            print(json.dumps(doc, indent=1), flush=True)
        else:
            if args.watch:
                print("\033[H\033[J", end="")  # clear the terminal between refreshes
            print(render_status(doc, time.time()), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


# ------------------------------------------------------------------ gc


def cmd_gc(args: argparse.Namespace) -> int:
    address = _address(args, "gc")
    request = pb.CollectRequest(job=args.job or "", dry_run=args.dry_run)
    reply = _call(address, "gc", lambda stub: stub.Collect(request, timeout=600.0))
    rows = [{"job": r.job, "step": r.step, "path": r.path, "reason": r.reason, "bytes": r.bytes} for r in reply.removed]
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "removed": rows}, indent=1))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in rows:
        what = f"step {r['step']}" if r["step"] >= 0 else "leftover"
        print(f"{verb} {r['reason']:<11} {r['job']:<20} {what:<14} {human_bytes(r['bytes']):>10}  {r['path']}")
    total = sum(r["bytes"] for r in rows)
    print(f"{verb} {len(rows)} item(s), {human_bytes(total)}" + (" (dry run: nothing was deleted)" if args.dry_run else ""))
    return 0


# ------------------------------------------------------------------ verify


def cmd_verify(args: argparse.Namespace) -> int:
    """`ckptd verify LOCATION`: a step directory, a job directory (each of its committed steps,
    newest last) or a step in an object store (s3://BUCKET/PREFIX/JOB/step-N, as `ckptd ls`
    shows it); exit 1 when any checked step has a problem."""
    from ckptd.daemon.remote.bucket_step import BucketStepError
    from ckptd.daemon.tools.verify import verify_step

    location: str = args.step_dir
    job_dir = not location.startswith("s3://") and _is_local_job(location)
    if job_dir:
        steps, interrupted = _steps_of_job(Path(location))
    else:  # a step directory, whatever its name (a copy set aside for inspection, say), or a step in a bucket
        steps, interrupted = [location], []
    try:
        reports = [verify_step(step, node=args.node) for step in steps]
    except BucketStepError as exc:
        _fail(f"ckptd verify: {exc}", 2)
    if args.json:
        docs = [_report_doc(r) for r in reports]
        if not job_dir:
            print(json.dumps(docs[0], indent=1))
        else:
            print(json.dumps({"job_dir": location, "ok": all(r.ok for r in reports), "steps": docs, "interrupted": interrupted}, indent=1))
        return 0 if all(r.ok for r in reports) else 1
    for report in reports:
        _print_report(report)
    for leftover in interrupted:
        print(f"note: {leftover} has no index: an interrupted save, not a checkpoint (`ckptd gc` removes it)")
    if len(reports) > 1 or interrupted:
        failed = [r for r in reports if not r.ok]
        print(f"{'FAILED' if failed else 'OK'}: {len(reports) - len(failed)} of {len(reports)} committed step(s) of {location} verified")
    return 0 if all(r.ok for r in reports) else 1


def _is_local_job(location: str) -> bool:
    """Whether `location` is a job directory (storage.is_job_dir); exits 2 when it is no
    directory at all, or a whole storage root."""
    path = Path(location)
    if path.is_symlink():
        _fail(f"ckptd verify: {path} is a symbolic link: no link under a storage root is followed; give the directory itself ({os.path.realpath(path)})", 2)
    if not path.is_dir():
        _fail(f"ckptd verify: {path} is not a directory; give a step directory such as ROOT/JOB/step-00001000, a job directory ROOT/JOB "
              "(`ckptd ls ROOT` lists them) or s3://BUCKET/PREFIX/JOB/step-00001000", 2)
    if is_storage_root(path):
        _fail(f"ckptd verify: {path} is a storage root; give one of its jobs (ROOT/JOB) or a step directory (ROOT/JOB/step-00001000)", 2)
    return is_job_dir(path)


def _steps_of_job(job_dir: Path) -> tuple[list[str], list[str]]:
    """A job directory's committed steps (in commit order) and its uncommitted ones, where they
    are; exits 2 when `job_dir` holds no step directory at all."""
    catalog = Storage(job_dir.parent).catalog
    try:
        committed = [catalog.step_location(job_dir.name, step) for step in catalog.commit_order(job_dir.name)]
        interrupted = [str(s.path) for s in catalog.uncommitted_steps(job_dir.name)]  # links not followed
    except ValueError as exc:  # not a valid job id
        _fail(f"ckptd verify: {job_dir} is neither a step directory nor a job directory ({exc})", 2)
    if not committed and not interrupted:
        _fail(f"ckptd verify: {job_dir} holds no step directory; give a step directory ROOT/JOB/step-00001000 or a job directory ROOT/JOB", 2)
    return committed, interrupted


def _report_doc(report: "VerifyReport") -> dict[str, object]:
    return {
        "step_dir": report.step_dir, "job": report.job, "step": report.step, "ok": report.ok,
        "files_checked": report.files_checked, "files_skipped": report.files_skipped,
        "bytes_checked": report.bytes_checked, "tensors": report.tensors,
        "problems": [{"kind": p.kind, "file": p.file, "message": p.message} for p in report.problems],
        "notes": list(report.notes),
    }


def _print_report(report: "VerifyReport") -> None:
    print(f"verifying {report.step_dir}" + (f" (job {report.job}, step {report.step})" if report.step >= 0 else ""))
    for p in report.problems:
        print(f"  PROBLEM [{p.kind}] {p.message}")
    for note in report.notes:
        print(f"  note: {note}")
    skipped = f", {report.files_skipped} file(s) of other nodes left out" if report.files_skipped else ""
    summary = f"{report.files_checked} file(s), {report.tensors} tensor(s), {human_bytes(report.bytes_checked)} read{skipped}"
    if report.ok:
        print(f"OK: {summary}; every checksum matches and every tensor is fully covered")
    else:
        print(f"FAILED: {len(report.problems)} problem(s); {summary}")


# ------------------------------------------------------------------ ls


def cmd_ls(args: argparse.Namespace) -> int:
    root = args.root
    if root is not None and root.startswith("s3://"):
        where, rows = _bucket_rows(root, args.job, args.all)
    else:
        if root is None:  # the running daemon's root
            address = _address(args, "ls")
            root = _call(address, "ls", lambda stub: stub.Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)).root
        where, rows = _root_rows(Path(root), args.job, args.all)
    rows.sort(key=lambda r: (r["job"], r["step"]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no committed checkpoints in {where}" + (f" for job {args.job}" if args.job else ""))
        return 0
    print(f"{'JOB':<20} {'STEP':>10}  {'CREATED':<19}  {'SIZE':>10}  {'FILES':>5}  {'TENSORS':>7}  {'RANKS':>5}  {'METRIC':>10}  PATH")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_at"])) if r["created_at"] is not None else "-"
        size = human_bytes(r["size_bytes"]) if r["size_bytes"] is not None else "-"
        files = str(r["files"]) if r["files"] is not None else "-"
        metric = f"{r['metric']:.6g}" if r["metric"] is not None else "-"
        tensors = str(r["tensors"]) if r["tensors"] is not None else "-"
        ranks = str(r["world_size"]) if r["world_size"] is not None else "-"
        notes = (["latest"] if r["latest"] else []) + ([f"rollback: committed after steps {_steps_text(r['rollback_over'])}"] if r["rollback_over"] else [])
        note = f"  ({'; '.join(notes)})" if notes else "" if r["state"] == "committed" else (
            "  (uncommitted: no index; an upload under way or interrupted, which the daemon's tier finishes or sweeps)"
            if r["path"].startswith("s3://") else "  (uncommitted: no index; `ckptd gc` removes it)"
        )
        print(
            f"{r['job']:<20} {r['step']:>10}  {created:<19}  {size:>10}  {files:>5}  {tensors:>7}  "
            f"{ranks:>5}  {metric:>10}  {r['path']}{note}"
        )
    return 0


def _steps_text(steps: list[int], limit: int = 8) -> str:
    return ", ".join(map(str, steps[:limit])) + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def _committed_row(job: str, index: CheckpointIndex, latest: bool, path: str, rollback_over: list[int]) -> dict[str, Any]:
    """A committed step's row; rollback_over: the higher steps committed before it (rollback.rollbacks), [] for none."""
    return {
        "job": job, "step": index.step, "state": "committed", "latest": latest, "rollback_over": rollback_over,
        "created_at": index.created_at, "size_bytes": index.size_bytes, "files": len(index.files) + 1,
        "tensors": len(index.tensors), "world_size": index.world_size, "nodes": int(index.writer.get("nodes", 1)),
        "metric": index.metric, "path": path,
    }


def _root_rows(root: Path, job: str | None, uncommitted: bool) -> tuple[str, list[dict[str, Any]]]:
    """The rows of `ckptd ls ROOT`: committed steps (and with `uncommitted`, step directories
    without an index) of `job`, else of every job."""
    storage = Storage(root)
    if not storage.root.is_dir():
        _fail(f"ckptd ls: {storage.root} is not a directory", 2)
    if not is_storage_root(storage.root):  # (a root is one whatever its jobs are named: "latest", like a step)
        if (storage.root / INDEX_NAME).is_file() or (parse_step_dir_name(storage.root.name) is not None and is_job_dir(storage.root.parent)):
            _fail(f"ckptd ls: {storage.root} is a step directory; `ckptd ls ROOT JOB` lists a job's steps, `ckptd inspect {storage.root}` shows this one", 2)
        if is_job_dir(storage.root):  # ROOT/JOB given as the root: its steps, as `ckptd ls ROOT JOB` lists them
            if job not in (None, storage.root.name):
                _fail(f"ckptd ls: {storage.root} is the directory of job {storage.root.name!r}, not a storage root holding job {job!r}", 2)
            return _root_rows(storage.root.parent, storage.root.name, uncommitted)
    rows = []
    for name in [job] if job else storage.catalog.jobs():
        try:
            steps = storage.catalog.commit_order(name)  # the newest is the most recently committed, not the highest step
        except ValueError as exc:
            _fail(f"ckptd ls: {exc}", 2)
        for problem in storage.catalog.not_followed(name):
            print(f"ckptd ls: not listed: {problem}", file=sys.stderr)
        marked = rollbacks(steps)
        for step in steps:
            try:
                index = storage.files.read_index(name, step)
            except (OSError, FormatError) as exc:
                print(f"ckptd ls: skipping step {step} of {name}: {exc}", file=sys.stderr)
                continue
            rows.append(_committed_row(name, index, step == steps[-1], storage.catalog.step_location(name, step), marked.get(step, [])))
        if uncommitted:
            rows += _uncommitted_rows(storage, name)
    return str(storage.root), rows


def _bucket_rows(url: str, job: str | None, uncommitted: bool) -> tuple[str, list[dict[str, Any]]]:
    """The rows of `ckptd ls s3://BUCKET/PREFIX` (remote/listing.py): committed steps in the
    bucket, and with `uncommitted` the steps with objects but no index (size, files and time
    unknown without reading them)."""
    from ckptd.daemon.remote.listing import ListingError, list_bucket  # obstore and boto3 only when asked

    try:
        location, jobs = list_bucket(url, job, os.environ)
    except ListingError as exc:
        _fail(f"ckptd ls: {exc}", 2)
    rows = []
    for steps in jobs:
        marked = rollbacks([index.step for index in steps.committed])
        for index in steps.committed:
            rows.append(_committed_row(steps.job, index, index is steps.committed[-1], location.url_of(steps.job, index.step), marked.get(index.step, [])))
        if uncommitted:
            rows += [_uncommitted_row(steps.job, step, location.url_of(steps.job, step)) for step in steps.uncommitted]
    return location.url, rows


def _uncommitted_row(job: str, step: int, path: str, created_at: float | None = None, size_bytes: int | None = None,
                     files: int | None = None) -> dict[str, Any]:
    """A step without an index, for `ls --all` (what is not known of it: None)."""
    return {
        "job": job, "step": step, "state": "uncommitted", "latest": False, "rollback_over": [], "created_at": created_at,
        "size_bytes": size_bytes, "files": files, "tensors": None, "world_size": None,
        "nodes": None, "metric": None, "path": path,
    }


def _uncommitted_rows(storage: Storage, job: str) -> list[dict[str, Any]]:
    """Step directories without an index (interrupted or in-flight saves), for `ls --all`."""
    return [
        _uncommitted_row(job, s.step, str(s.path), s.mtime, s.nbytes, s.files)
        for s in storage.catalog.uncommitted_steps(job)  # links not followed
    ]


# ------------------------------------------------------------------ argument parsers


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the daemon's socket (its --socket), unix:///path.sock or the path (default: $CKPTD_ADDRESS, else the default socket)")
    parser.add_argument("--job", help="only this job's checkpoints in flight")
    parser.add_argument("--watch", type=_watch_seconds, metavar="SECONDS", default=0.0, help="refresh every SECONDS until interrupted")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_gc_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the daemon's socket (its --socket), unix:///path.sock or the path (default: $CKPTD_ADDRESS, else the default socket)")
    parser.add_argument("--job", help="only this job (default: every job under the daemon's root)")
    parser.add_argument("--dry-run", action="store_true", help="show what would be removed; remove nothing")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("step_dir", metavar="LOCATION", help="a committed step directory, e.g. ROOT/JOB/step-00001000, a job directory ROOT/JOB (all its committed steps), "
                        "or a step in an object store, s3://BUCKET/PREFIX/JOB/step-00001000 (as `ckptd ls` shows it; credentials as for `ckptd serve --remote`)")
    parser.add_argument("--node", type=_node_rank, default=None, metavar="N", help="node-local roots: check only the data files node N wrote (default: all)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _node_rank(text: str) -> int:
    """--node's value: a node rank, 0 or more (argparse names the flag in its error)."""
    rank = decimal(text, 9)
    if rank is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node rank (0, 1, ...: the --node-rank its daemon was started with)")
    return rank


def _watch_seconds(text: str) -> float:
    """--watch's value: a number of seconds > 0 (argparse names the flag in its error)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0 (e.g. 2)")
    return seconds


def add_ls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "root", nargs="?",
        help="the daemon's --root, or an object store location s3://BUCKET/PREFIX (its --remote; credentials from the standard "
        "AWS variables and files) (default: ask the running daemon for its root, see --address)",
    )
    parser.add_argument("job", nargs="?", help="only this job")
    parser.add_argument("--address", help="without ROOT: the daemon to ask, unix:///path.sock (default: $CKPTD_ADDRESS, else the default socket)")
    parser.add_argument("--all", action="store_true", help="also list uncommitted step directories (interrupted or in-flight saves)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
