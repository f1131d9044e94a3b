"""The `ckptd` command: serve, demo, ls, status, verify, gc, export, inspect, import."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

# `ckptd import --format` choices: the keys of ckptd.daemon.importer.importing.FORMATS, named here because
# importing imports torch, which no other command needs at start (tests check they agree).
IMPORT_FORMATS = ("torch", "hf", "safetensors", "dcp")

# Context a log call may attach with extra={...}; JSON lines carry them as fields.
LOG_CONTEXT = ("job", "step", "rank", "cause")


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, node, and job/step/rank/cause when known."""

    def __init__(self, node: int = 0) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": record.created, "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(), "node": self.node}
        for key in LOG_CONTEXT:
            if key in record.__dict__:
                doc[key] = record.__dict__[key]
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str, as_json: bool, node: int = 0) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(node) if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _serve(args: argparse.Namespace) -> int:
    import faulthandler
    import signal

    from ckptd.daemon.app.server import run
    from ckptd.daemon.config import ConfigError, config_from_args

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr (a hang)
    try:
        config = config_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"ckptd serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_json, config.node_rank)
    try:
        return run(config, reload=lambda: config_from_args(args, os.environ))
    except (OSError, RuntimeError, ValueError) as exc:
        logging.getLogger("ckptd").error("cannot serve: %s", exc)
        return 1


def _export(args: argparse.Namespace) -> int:
    from ckptd.daemon.tools.export import ExportError, export_model

    if args.format == "dcp":
        return _export_dcp(args)
    try:
        files = export_model(args.step_dir, Path(args.out))
    except (ExportError, OSError) as exc:
        print(f"ckptd export: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(f"{path.stat().st_size:>14}  {path}")
    return 0


def _export_dcp(args: argparse.Namespace) -> int:
    from ckptd.client.errors import CheckpointError
    from ckptd.integrations.dcp import export_dcp

    try:
        keys = export_dcp(args.step_dir, Path(args.out))
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"ckptd export: {exc}", file=sys.stderr)
        return 1
    print(f"{len(keys)} entries written as a torch.distributed.checkpoint directory: {args.out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from ckptd.daemon.tools.inspect import InspectError, run

    try:
        print(run(args.step_dir, args.json))
    except InspectError as exc:
        print(f"ckptd inspect: {exc}", file=sys.stderr)
        return 2
    return 0


def _import(args: argparse.Namespace) -> int:
    from ckptd.daemon.errors import CkptdError
    from ckptd.daemon.importer.importing import ImportRefused, import_checkpoint

    setup_logging("error", as_json=False)  # what is not imported is in the report printed below
    try:
        report = import_checkpoint(args.source, args.root, args.job, args.step, source_format=args.format)
    except (ImportRefused, CkptdError, OSError) as exc:  # CkptdError: NoSpace before anything is written
        print(f"ckptd import: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_json(), indent=1) if args.json else report.describe())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ckptd.demo import main as demo

    return demo.run(args)


def version() -> str:
    """The installed ckptd's version (package metadata; the source tree's own when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("ckptd")
    except PackageNotFoundError:
        from ckptd.daemon.plan.files import VERSION

        return VERSION


def build_parser() -> argparse.ArgumentParser:
    from ckptd.daemon.config import add_serve_arguments

    parser = argparse.ArgumentParser(prog="ckptd", description="Per-node checkpoint daemon for distributed training.")
    parser.add_argument("--version", action="version", version=f"ckptd {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    from ckptd.daemon.tools import ops

    operator_commands = (
        ("ls", "list checkpoints under a storage root: step, time, size, tensors, metric", ops.add_ls_arguments, ops.cmd_ls),
        ("status", "what the running daemon is doing: checkpoints in flight, queue, arena memory, last commit",
         ops.add_status_arguments, ops.cmd_status),
        ("verify", "check a step's (or every committed step of a job's) files, checksums and coverage; exit 1 on any problem",
         ops.add_verify_arguments, ops.cmd_verify),
        ("gc", "apply retention now and remove uncommitted leftovers (asks the running daemon)", ops.add_gc_arguments, ops.cmd_gc),
    )
    for name, help_text, add_arguments, command in operator_commands:
        command_parser = sub.add_parser(name, help=help_text)
        add_arguments(command_parser)
        command_parser.set_defaults(func=command)

    export = sub.add_parser("export", help="write a consolidated Hugging Face-loadable copy of a step's model weights")
    export.add_argument("step_dir", metavar="LOCATION", help="a committed step directory, e.g. ROOT/JOB/step-00001000, or s3://BUCKET/PREFIX/JOB/step-00001000 (--format safetensors)")
    export.add_argument("out", help="a new directory to write")
    export.add_argument(
        "--format", choices=("hf", "dcp"), default="hf",
        help="hf (default): the model weights, whole, as Hugging Face safetensors shards; dcp: every tensor as a torch.distributed.checkpoint directory",
    )
    export.set_defaults(func=_export)

    inspect = sub.add_parser("inspect", help="show a committed step: tensors, fragments, quantization, sizes")
    inspect.add_argument("step_dir", metavar="LOCATION", help="a committed step directory, e.g. ROOT/JOB/step-00001000, or s3://BUCKET/PREFIX/JOB/step-00001000")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=_inspect)

    importer = sub.add_parser(
        "import", help="write a torch.save file, a Hugging Face model directory or a torch.distributed.checkpoint directory "
        "as a committed step (no daemon needed)",
    )
    importer.add_argument("source", metavar="SOURCE", help="a torch.save file (.pt/.bin), a .safetensors file, a Hugging Face model directory or a DCP directory")
    importer.add_argument("--root", required=True, help="the storage root (the --root of `ckptd serve`; new or empty is fine)")
    importer.add_argument("--job", required=True, help="the job to import into, e.g. run-42")
    importer.add_argument("--step", required=True, type=int, help="the step number to write; an existing step is never overwritten")
    importer.add_argument("--format", choices=("auto", *IMPORT_FORMATS), default="auto", help="what SOURCE is (default: auto, from the file or directory)")
    importer.add_argument("--json", action="store_true", help="machine-readable output")
    importer.set_defaults(func=_import)

    demo = sub.add_parser("demo", help="a daemon + a small multi-rank training job: save, crash, resume")
    from ckptd.demo import main as demo_module

    demo_module.add_arguments(demo)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `ckptd ls ROOT | head`: the reader stopped reading; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's final flush is quiet
        return 141


if __name__ == "__main__":
    sys.exit(main())
