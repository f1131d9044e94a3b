"""`ckptd demo`: a real daemon, a 2-rank gloo job that is killed mid-run, restarted and resumed."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.demo import main as demo


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--crash-at", "50"], "--crash-at must be between"),
        (["--ranks", "1"], "--crash-at needs --ranks >= 2"),
        (["--ranks", "3"], "not divisible by 3 ranks"),
        (["--save-every", "0"], "must be >= 1"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.run(_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_a_non_empty_workdir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "something").write_text("x")
    assert demo.run(_args("--workdir", str(tmp_path))) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_crashes_resumes_and_finishes(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    cmd = [
        sys.executable, "-m", "ckptd.demo.main", "--steps", "12", "--save-every", "4", "--crash-at", "10",
        "--corpus-bytes", "300000", "--workdir", str(workdir), "--timeout", "120",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = done.stdout
    assert done.returncode == 0, f"stdout:\n{out}\nstderr:\n{done.stderr}"
    assert "rank 1: crashing at step 10" in out
    assert re.search(r"^\s*resumed from step 8 \(load took", out, re.MULTILINE), out
    # Steps 9 of the first run and of the resumed run saw the same weights, optimizer state and batch.
    assert "losses identical to the run before the crash" in out, out
    job = workdir / "root" / demo.DEMO_JOB
    newest = job / (job / "latest").read_text().strip()
    assert newest.name == "step-00000012"
    assert (newest / "ckptd.index.json").is_file()
    assert any(f.name.startswith("model-") and f.suffix == ".safetensors" for f in newest.iterdir())
