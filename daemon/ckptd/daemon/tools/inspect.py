"""`ckptd inspect STEP_DIR [--json]`: what a committed step holds, read from its index only.

Tensors (kind, dtype, shape), their fragments (file, key, box, stored dtype, bytes), how each
is compressed (codec, block size, scale tensor, residual base), the step's quantization record
(generation, scheme, master weights), sizes per group of files, and the environment record
(environment.json: versions, layout, run config) when the step has one.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptd.common import dtypes, json_read
from ckptd.common.sizes import human_bytes
from ckptd.format.index import ENVIRONMENT_JSON, INDEX_NAME, CheckpointIndex, FormatError, TensorRecord, check_small_file
from ckptd.daemon.remote.bucket_step import BucketStepError
from ckptd.daemon.storage import StepReader
from ckptd.daemon.tools.locate import open_step_reader


class InspectError(ValueError):
    """The directory is not a committed step (or its index is damaged); the message says which."""


def read_step(location: str | os.PathLike[str]) -> CheckpointIndex:
    """The index of the step at `location` (a step directory, or s3://.../JOB/step-N)."""
    return read_index_of(_open(location))


def read_index_of(step: StepReader) -> CheckpointIndex:
    """The index of the step that `step` reads (any backend); InspectError when there is none
    or it is damaged (a link or FIFO in its place is not followed: InspectError names it)."""
    try:
        data = step.read_small(INDEX_NAME)
    except FileNotFoundError:
        what = "does not exist" if "://" not in str(step.where) and not os.path.lexists(step.where) else f"has no {INDEX_NAME}"
        raise InspectError(f"{step.where} {what}: it is not a committed step directory (give ROOT/JOB/step-NNNNNNNN)") from None
    except OSError as exc:
        raise InspectError(f"cannot read the index of {step.where}: {exc}") from None
    try:
        return CheckpointIndex.from_json_bytes(data, f"{step.where}/{INDEX_NAME}")
    except FormatError as exc:
        raise InspectError(str(exc)) from None


def read_environment(step: StepReader, index: CheckpointIndex) -> dict[str, Any] | None:
    """The step's environment record, checked against its index entry; None for a step written
    before ckptd kept one. InspectError when it is listed but damaged."""
    record = index.file(ENVIRONMENT_JSON)
    if record is None:
        return None
    try:
        data = step.read_small(ENVIRONMENT_JSON, max(record.size, 1))
        check_small_file(record, data)
        doc = json_read.loads(data)
    except (OSError, FormatError, ValueError) as exc:
        raise InspectError(f"{step.where}/{ENVIRONMENT_JSON} cannot be read: {exc}; `ckptd verify {step.where}` shows what else is damaged") from None
    if not isinstance(doc, dict):
        raise InspectError(f"{step.where}/{ENVIRONMENT_JSON} is not a JSON object")
    return doc


def summary(index: CheckpointIndex, environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """The index as a JSON-able report: the index's own records plus derived sizes, and the
    environment record when given."""
    groups: dict[str, int] = {}
    for f in index.files:
        group = f.name.split("-", 1)[0].split(".", 1)[0]
        groups[group] = groups.get(group, 0) + f.size
    tensors = {}
    for t in index.tensors:
        doc = t.to_json()
        doc["logical_bytes"] = dtypes.nbytes(t.dtype, t.shape)
        doc["stored_bytes"] = _stored_bytes(t)
        tensors[t.name] = doc
    return {
        "job": index.job,
        "step": index.step,
        "created_at": index.created_at,
        "world_size": index.world_size,
        "metric": index.metric,
        "quantization": index.quantization,
        "environment": environment,
        "size_bytes": index.size_bytes,
        "bytes_by_group": dict(sorted(groups.items())),
        "files": {f.name: f.to_json() for f in index.files},
        "tensors": tensors,
    }


def _stored_bytes(t: TensorRecord) -> int:
    """Bytes this tensor adds to the step: its fragments and their scales; a dropped master
    weight ("cast") adds none, it is the model weight's bytes."""
    return sum(piece.nbytes for f in t.fragments for piece in f.stored_pieces())


def render(report: dict[str, Any]) -> str:
    """The report for people: a header, sizes, then one line per tensor and per fragment."""
    q = report["quantization"]
    lines = [
        f"job {report['job']}  step {report['step']}  world size {report['world_size']}  {human_bytes(report['size_bytes'])} in {len(report['files'])} files",
        "quantization: "
        + (
            "none (lossless, generation 0)"
            if q is None
            else f"generation {q.get('generation', 0)}, optimizer moments {q.get('quantize') or 'lossless'}, master weights {q.get('master_weights', 'keep')}"
        ),
        "bytes by group: " + ", ".join(f"{g} {human_bytes(n)}" for g, n in report["bytes_by_group"].items()),
        *_environment_lines(report.get("environment")),
        "",
        f"{'TENSOR':<48} {'KIND':<9} {'DTYPE':<5} {'SHAPE':<16} {'STORED':>10}  CODEC",
    ]
    for name, t in report["tensors"].items():
        codecs = sorted({(f.get("quant") or {}).get("codec", "-") for f in t["fragments"]})
        lines.append(
            f"{name:<48} {t['kind']:<9} {t['dtype']:<5} {str(t['shape']):<16} {human_bytes(t['stored_bytes']):>10}  {','.join(codecs)}"
        )
        for f in t["fragments"]:
            box = "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(f["offsets"], f["lengths"])) + "]"
            detail = f"    {f['file']} {f['key']} {box} {f['dtype']} {f['nbytes']} B"
            quant = f.get("quant")
            if quant:
                detail += f"  {quant['codec']}"
                if quant.get("block"):
                    detail += f" block {quant['block']}"
                if "scales" in quant:
                    s = quant["scales"]
                    detail += f" scales {s['key']} {s['dtype']}{s['shape']}"
                if "frames" in quant:
                    fr = quant["frames"]
                    detail += f" in {len(fr['ends'])} {fr['coder']} frames of {fr['rows']} rows"
                if "base" in quant:
                    detail += f" + base {quant['base']['file']}:{quant['base']['key']}"
            if len(t["fragments"]) > 1 or quant:
                lines.append(detail)
    return "\n".join(lines)


def _environment_lines(env: dict[str, Any] | None) -> list[str]:
    """The environment record in a few lines (the whole of it is in --json)."""
    if env is None:
        return ["environment: not recorded (a step written before ckptd kept one)"]
    trainer, layout, daemon = env.get("trainer") or {}, env.get("layout") or {}, env.get("daemon") or {}
    lines = [
        f"written by: python {trainer.get('python', '?')}, torch {trainer.get('torch', '?')}, ckptd {trainer.get('ckptd', '?')} "
        f"(daemon: ckptd {daemon.get('ckptd', '?')} on {daemon.get('host', '?')})",
        f"layout: world size {layout.get('world_size', '?')} on {layout.get('nodes', '?')} nodes, ranks per node {layout.get('ranks_per_node', '?')}"
        + "".join(f"; mesh {m.get('shape')} {m.get('dim_names') or ''}".rstrip() for m in trainer.get("device_meshes", []))
        + (f"; tensor parallel {trainer['tensor_parallel']}" if "tensor_parallel" in trainer else ""),
    ]
    if "run_config" in trainer:
        lines.append("run config: " + json.dumps(trainer["run_config"], sort_keys=True)[:2000])
    return lines


def run(location: str | os.PathLike[str], as_json: bool) -> str:
    """`ckptd inspect LOCATION`: a step directory, or s3://BUCKET/PREFIX/JOB/step-N."""
    step = _open(location)
    index = read_index_of(step)
    report = summary(index, read_environment(step, index))
    return json.dumps(report, indent=1) if as_json else render(report)


def _open(location: str | os.PathLike[str]) -> StepReader:
    try:
        return open_step_reader(location)
    except BucketStepError as exc:
        raise InspectError(str(exc)) from None
