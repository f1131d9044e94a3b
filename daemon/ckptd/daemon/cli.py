"""The `ckptd` command: serve, demo, ls, export, inspect."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from ckptd.daemon.format import FormatError
from ckptd.daemon.storage import Storage


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": record.created, "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _serve(args: argparse.Namespace) -> int:
    from ckptd.daemon.config import ConfigError, config_from_args
    from ckptd.daemon.server import run

    try:
        config = config_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"ckptd serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_json)
    try:
        return run(config)
    except (OSError, RuntimeError, ValueError) as exc:
        logging.getLogger("ckptd").error("cannot serve: %s", exc)
        return 1


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _ls(args: argparse.Namespace) -> int:
    storage = Storage(Path(args.root))
    if not storage.root.is_dir():
        print(f"ckptd ls: {storage.root} is not a directory", file=sys.stderr)
        return 2
    jobs = [args.job] if args.job else storage.jobs()
    rows = []
    for job in jobs:
        try:
            steps = storage.committed_steps(job)
        except ValueError as exc:
            print(f"ckptd ls: {exc}", file=sys.stderr)
            return 2
        for step in steps:
            try:
                index = storage.read_index(job, step)
            except (OSError, FormatError) as exc:
                print(f"ckptd ls: skipping step {step} of {job}: {exc}", file=sys.stderr)
                continue
            rows.append(
                {
                    "job": job,
                    "step": step,
                    "created_at": index.created_at,
                    "size_bytes": index.size_bytes,
                    "files": len(index.files) + 1,
                    "path": str(storage.step_dir(job, step)),
                }
            )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no committed checkpoints in {storage.root}" + (f" for job {args.job}" if args.job else ""))
        return 0
    print(f"{'JOB':<20} {'STEP':>10}  {'CREATED':<19}  {'SIZE':>10}  {'FILES':>5}  PATH")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_at"]))
        print(f"{r['job']:<20} {r['step']:>10}  {created:<19}  {_human_bytes(r['size_bytes']):>10}  {r['files']:>5}  {r['path']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ckptd.daemon.export import ExportError, export_model

    try:
        files = export_model(Path(args.step_dir), Path(args.out))
    except (ExportError, OSError) as exc:
        print(f"ckptd export: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(f"{path.stat().st_size:>14}  {path}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from ckptd.daemon.inspect import InspectError, run

    try:
        print(run(Path(args.step_dir), args.json))
    except InspectError as exc:
        print(f"ckptd inspect: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ckptd.daemon import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    from ckptd.daemon.config import add_serve_arguments

    parser = argparse.ArgumentParser(prog="ckptd", description="Per-node checkpoint daemon for distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    ls = sub.add_parser("ls", help="list committed checkpoints under a storage root")
    ls.add_argument("root", help="the daemon's --root")
    ls.add_argument("job", nargs="?", help="only this job")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_ls)

    export = sub.add_parser("export", help="write a consolidated Hugging Face-loadable copy of a step's model weights")
    export.add_argument("step_dir", help="a committed step directory, e.g. ROOT/JOB/step-00001000")
    export.add_argument("out", help="a new directory to write")
    export.set_defaults(func=_export)

    inspect = sub.add_parser("inspect", help="show a committed step: tensors, fragments, quantization, sizes")
    inspect.add_argument("step_dir", help="a committed step directory, e.g. ROOT/JOB/step-00001000")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=_inspect)

    demo = sub.add_parser("demo", help="a daemon + a small multi-rank training job: save, crash, resume")
    from ckptd.daemon import demo as demo_module

    demo_module.add_arguments(demo)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
