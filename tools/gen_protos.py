"""Generate the Python wire code in client/ckptd/wire/v1 from protos/ (the source of truth).

Usage: python tools/gen_protos.py [--check]

--check regenerates into a temporary directory and exits 1 if the committed files differ,
so a stale stub is caught by the test suite (tests/test_wire.py).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
# Generated modules land in client/ckptd/wire/v1/ and import each other as ckptd.wire.v1.
# The descriptors keep their proto names (ckptd/v1/*.proto), so they never clash with
# another library's protos in the global descriptor pool.
GENERATED_DIR = REPO / "client" / "ckptd" / "wire" / "v1"
INIT_TEXT = '"""Generated from protos/ckptd/v1 by tools/gen_protos.py; do not edit."""\n'


def _protos() -> list[Path]:
    return sorted((PROTO_ROOT / "ckptd" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> Path:
    """Run protoc (from grpcio-tools) and write the generated modules into out_dir."""
    from grpc_tools import protoc  # imported here: only developers need grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p) for p in _protos()],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for path in sorted((Path(tmp) / "ckptd" / "v1").iterdir()):
            # protoc writes imports rooted at the proto package ("from ckptd.v1 import");
            # the generated package lives at ckptd.wire.v1.
            text = path.read_text().replace("from ckptd.v1 import", "from ckptd.wire.v1 import")
            (out_dir / path.name).write_text(text)
    (out_dir / "__init__.py").write_text(INIT_TEXT)
    return out_dir


def stale_files() -> list[str]:
    """Names of generated files that differ from what protos/ generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp) / "v1")
        return [
            p.name
            for p in sorted(fresh.iterdir())
            if not (GENERATED_DIR / p.name).exists()
            or not filecmp.cmp(p, GENERATED_DIR / p.name, shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(GENERATED_DIR)
        return 0
    stale = stale_files()
    if stale:
        print(f"stale generated code: {', '.join(stale)}; run: python tools/gen_protos.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
