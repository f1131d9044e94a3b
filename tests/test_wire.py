"""The committed gRPC stubs are generated from protos/ and must not be stale."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_current() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    stale = gen_protos.stale_files()
    assert not stale, f"regenerate with `python tools/gen_protos.py`: {stale}"
