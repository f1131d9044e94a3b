"""ckptd.common.retention: a save's metric, checked at the client's boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptd.common.retention import check_metric


@pytest.mark.parametrize("value, expected", [(None, None), (1, 1.0), (0.25, 0.25), (torch.tensor(2.5), 2.5), (torch.tensor([0.5]), 0.5), (np.float32(1.5), 1.5)])
def test_a_metric_is_a_number_or_a_one_element_tensor(value: object, expected: float | None) -> None:
    assert check_metric(value) == expected


@pytest.mark.parametrize(
    "value, error, words",
    [
        ("0.5", TypeError, "metric='0.5': pass a number"),
        (True, TypeError, "metric=True: pass a number"),
        (1j, TypeError, "metric=1j: pass a number"),
        (torch.ones(2), ValueError, "is not one float"),
        (10**400, ValueError, "is not one float"),
    ],
)
def test_a_metric_that_is_not_one_number_is_refused_naming_metric(value: object, error: type[Exception], words: str) -> None:
    """Found by a probe: torch's and float()'s own errors, which did not say `metric`; True was taken as 1.0."""
    with pytest.raises(error, match=words):
        check_metric(value)
