"""ckptd.client.fqns: names without the prefixes of torch's module wrappers, by name (the importer)
and by module (the client)."""

from __future__ import annotations

import pytest
import torch

from ckptd.client.fqns import canonical_fqns, module_fqns, strip_wrappers


@pytest.mark.parametrize(
    "fqn, expected",
    [
        ("w", "w"),
        ("_orig_mod.w", "w"),
        ("a._orig_mod.b._fsdp_wrapped_module.c._checkpoint_wrapped_module.w", "a.b.c.w"),
        ("a._orig_mod._orig_mod.w", "a.w"),
        ("my_orig_mod.w", "my_orig_mod.w"),  # only whole components
        ("module.w", "module.w"),  # DDP's prefix is the top's only (canonical_fqns)
    ],
)
def test_strip_wrappers(fqn: str, expected: str) -> None:
    assert strip_wrappers(fqn) == expected


@pytest.mark.parametrize(
    "names, expected",
    [
        ([], {}),
        (["module.a", "module.b._orig_mod.c"], {"module.a": "a", "module.b._orig_mod.c": "b.c"}),
        (["module.a", "b"], {"module.a": "module.a", "b": "b"}),  # a user's own "module": not every name has it
        (["module.module.a"], {"module.module.a": "module.a"}),
    ],
)
def test_canonical_fqns_by_name(names: list[str], expected: dict[str, str]) -> None:
    assert canonical_fqns(names) == expected


def test_module_fqns_agree_with_canonical_fqns_on_a_compiled_model() -> None:
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.compile(torch.nn.Linear(2, 2)))
    model = torch.compile(inner)
    keys = list(model.state_dict())
    canonical = module_fqns(model)
    assert {k: canonical(k) for k in keys} == canonical_fqns(keys) == {
        "_orig_mod.0.weight": "0.weight", "_orig_mod.0.bias": "0.bias", "_orig_mod.1._orig_mod.weight": "1.weight", "_orig_mod.1._orig_mod.bias": "1.bias",
    }
