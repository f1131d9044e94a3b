"""The tier's pure pieces (remote/tier.py); the tier against a real S3 server is test_s3_tier.py."""

from __future__ import annotations

import pytest

from ckptd.daemon.remote.tier import backoff_s


@pytest.mark.parametrize(
    "failures, first, cap, want",
    [(1, 1.0, 30.0, 1.0), (2, 1.0, 30.0, 2.0), (5, 1.0, 30.0, 16.0), (6, 1.0, 30.0, 30.0), (1, 10.0, 300.0, 10.0),
     (6, 10.0, 300.0, 300.0), (100_000, 1.0, 30.0, 30.0), (1, 1.0, 0.05, 0.05)],
)
def test_the_retry_wait_doubles_up_to_its_cap_and_never_overflows(failures: int, first: float, cap: float, want: float) -> None:
    assert backoff_s(failures, first, cap) == want
