"""The Docker image's build context (issue 22 item 9). No container engine here can pull a base
image, so this checks what can be checked: after `.dockerignore` filters the repository (with
Docker's rules), every file the Dockerfile COPYs is in the context, and the project builds into a
wheel from that context alone and installs from it. `.dockerignore` once left out `setup.py`,
which the Dockerfile copies: `docker build` could not succeed, and nothing noticed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def ignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(is an exception, pattern) for each rule of a .dockerignore, in order. Docker's rules
    (moby patternmatcher): paths relative to the context, `*` and `?` stop at '/', `**` spans
    directories, a leading '!' re-includes, and a rule that matches a directory matches all
    that is below it; the last rule that matches a path decides."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((exception, re.compile(regex + "$")))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the context keeps `path` (relative, '/'-separated)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    kept = True
    for exception, pattern in rules:
        if any(pattern.match(prefix) for prefix in prefixes):
            kept = exception
    return kept


@pytest.mark.parametrize(
    ("rules", "path", "kept"),
    [
        ("*\n!client/\n", "client/ckptd/a.py", True),
        ("*\n!client/\n", "tests/x.py", False),
        ("*\n!client/\n**/__pycache__\n", "client/ckptd/__pycache__/a.pyc", False),
        ("*\n!setup.py\n", "setup.py", True),
        ("*\n", "setup.py", False),
        ("docs\n!docs/keep.md\n", "docs/keep.md", True),
        ("**/build\n", "client/build/lib/x.py", False),
    ],
)
def test_the_dockerignore_rules_as_docker_applies_them(rules: str, path: str, kept: bool) -> None:
    assert in_context(path, ignore_rules(rules)) is kept


def copied_sources(dockerfile: str) -> list[str]:
    """The context paths the Dockerfile's COPY/ADD instructions read (not --from= stages)."""
    sources = []
    for line in dockerfile.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        sources += args[:-1]
    return sources


def build_context(tmp_path: Path) -> Path:
    """A copy of what `docker build .` would send: the repository's files that .dockerignore keeps."""
    rules = ignore_rules((REPO / ".dockerignore").read_text())
    context = tmp_path / "context"
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            path = Path(root, name)
            relative = path.relative_to(REPO).as_posix()
            if in_context(relative, rules) and not path.is_symlink():
                (context / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, context / relative)
    return context


def test_every_file_the_dockerfile_copies_is_in_the_build_context(tmp_path: Path) -> None:
    context = build_context(tmp_path)
    sources = copied_sources((REPO / "Dockerfile").read_text())
    assert {"pyproject.toml", "setup.py", "README.md", "client", "daemon"} <= set(sources), sources
    missing = [s for s in sources if not (context / s).exists()]
    assert missing == [], f"COPY sources that .dockerignore leaves out of the build context: {missing}"
    assert not (context / "tests").exists() and not (context / ".git").exists()


def test_the_project_builds_and_installs_from_the_build_context_alone(tmp_path: Path) -> None:
    """As the image's build stage does (`pip wheel --no-deps .` in the context), without the network."""
    context = build_context(tmp_path)
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(context)],
        capture_output=True, text=True, timeout=600,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = wheels.glob("ckptd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "ckptd/daemon/app/cli.py", "ckptd/client/__init__.py", "ckptd/daemon/engine/saves.py", "ckptd/daemon/storage/posix.py", "ckptd/client/py.typed",
        # the client root's packages beside the client (issue 32 R2)
        "ckptd/format/units.py", "ckptd/format/py.typed", "ckptd/client/reader/fill.py", "ckptd/offline/root.py", "ckptd/integrations/dcp.py",
    ):
        assert needed in names, needed
    assert any(n.startswith("ckptd/common/_codec.") and n.endswith(".so") for n in names)
    assert any(n.startswith("ckptd/common/_copy.") and n.endswith(".so") for n in names)
    target = tmp_path / "installed"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    # -S: only the installed copy on the path (not the checkout nor the test venv's ckptd)
    probe = "import sys; sys.path.insert(0, sys.argv[1]); import ckptd.common._copy as c, ckptd.common.boxes as b; print(c.__file__); print(b.__file__)"
    ran = subprocess.run([sys.executable, "-S", "-c", probe, str(target)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert all(line.startswith(str(target)) for line in ran.stdout.split()), ran.stdout
