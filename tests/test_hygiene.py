"""Rules of the code base that a reviewer would otherwise have to check by hand."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted((REPO / "client").rglob("*.py")) + sorted((REPO / "daemon").rglob("*.py"))
GENERATED = REPO / "client" / "ckptd" / "wire"


def test_nothing_is_ever_unpickled() -> None:
    banned = re.compile(r"\bimport pickle\b|\bpickle\.|torch\.load\(|torch\.save\(|\bmarshal\.|\bshelve\b")
    offenders = [str(p.relative_to(REPO)) for p in SOURCES if banned.search(p.read_text())]
    assert offenders == []


def test_no_silently_swallowed_errors() -> None:
    bare = re.compile(r"except\s*:|except\s+(Base)?Exception\s*:\s*\n\s*pass\b")
    offenders = [str(p.relative_to(REPO)) for p in SOURCES if not p.is_relative_to(GENERATED) and bare.search(p.read_text())]
    assert offenders == []


def test_the_client_never_imports_the_daemon() -> None:
    client = [p for p in SOURCES if p.is_relative_to(REPO / "client")]
    offenders = [str(p.relative_to(REPO)) for p in client if "ckptd.daemon" in p.read_text()]
    assert offenders == []


def test_the_pure_core_does_no_io_and_no_rpc() -> None:
    pure = [REPO / f for f in ("daemon/ckptd/daemon/plan.py", "daemon/ckptd/daemon/format.py", "client/ckptd/common/boxes.py", "client/ckptd/common/reshard.py", "client/ckptd/common/quant.py", "client/ckptd/common/quant_options.py")]
    banned = re.compile(r"^\s*(import|from)\s+(grpc|asyncio|os|shutil|pathlib)\b", re.M)
    assert [str(p.relative_to(REPO)) for p in pure if banned.search(p.read_text())] == []
