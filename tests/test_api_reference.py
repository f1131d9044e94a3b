"""docs/api.md is generated from the docstrings (tools/gen_api_reference.py) and must match the code."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "gen_api_reference.py"


def test_api_reference_is_up_to_date() -> None:
    # A fresh interpreter: the integrations' libraries are imported there, not into the test session.
    result = subprocess.run([sys.executable, str(TOOL), "--check"], cwd=REPO, capture_output=True, text=True, timeout=240)
    if result.returncode == 3:
        pytest.skip(f"an optional library is missing, docs/api.md cannot be checked here:\n{result.stderr}")
    if result.returncode != 0:
        pytest.fail(
            "docs/api.md does not match the docstrings: run `python tools/gen_api_reference.py` and commit docs/api.md\n"
            + result.stderr[-4000:],
            pytrace=False,
        )
