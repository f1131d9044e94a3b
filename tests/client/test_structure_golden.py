"""The fingerprint of a structure is a contract: the daemon keys a rank's metadata by it, and old
daemons and plans rely on it, so it must never drift. These digests were computed before the
first structure build got its fast path (issue 33, item 5); any change to how a fingerprint is
encoded shows up here."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ckptd.client.layout import Fused, LayoutRules, PaddedVocab, RankCoords, Replicated, Rule, Split
from ckptd.client.shards import LocalShard, LocalShards
from ckptd.client.state import flatten_state
from ckptd.client.structure import StructureCache
from ckptd.client.walk import StateWalk


def plain_state() -> dict[str, Any]:
    """Plain tensors and parameters of several dtypes and shapes (0-dim, empty, transposed),
    optimizer-like state and an extras key (per-rank tensors)."""
    return {
        "model": {
            "w": nn.Parameter(torch.zeros(3, 4)),
            "b": torch.zeros(4),
            "scalar": torch.tensor(1.0),
            "empty": torch.zeros(0, 5),
            "half": torch.zeros(2, 2, dtype=torch.float16),
            "bf": torch.zeros(7, dtype=torch.bfloat16),
            "ids": torch.arange(3),
            "mask": torch.zeros(2, 3, dtype=torch.bool),
            "fp8": torch.zeros(4, dtype=torch.float8_e4m3fn),
            "t": torch.zeros(4, 3).t(),
            "deep": torch.zeros(1, 2, 3, 4, 5),
        },
        "optimizer": {"state": {"w": {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "extra": {"ema": [torch.zeros(2)], "n": 3},
    }


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.qkv = nn.Linear(4, 12, bias=False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)
        self.norm.weight.requires_grad_(False)
        self.register_buffer("pos", torch.zeros(6))


def mixed_state() -> dict[str, Any]:
    """A module with a tied weight, a frozen parameter and a buffer, LocalShard(s) and per-rank extras."""
    return {
        "model": _Tied(),
        "sharded": {"a": LocalShard(torch.zeros(2, 3), (2, 0), (8, 3)), "many": LocalShards([LocalShard(torch.zeros(1, 3), (0, 0), (4, 3)),
                                                                                             LocalShard(torch.zeros(1, 3), (3, 0), (4, 3))])},
        "extra": {"t": torch.zeros(2)},
    }


RULES = [
    Rule(r"qkv\.weight", Fused(0, (8, 8, 8))),
    Rule(r"(embed|head)\.weight", PaddedVocab(0, 9)),
    Rule(r"norm\..*", Replicated()),
    Rule(r"pos", Split(0)),
]

GOLDEN = {
    ("plain", 0): "7aff81da4975c32e22f85fc25bfe3fbf3d4315f8c0a693e3ebe8a163b6ac50e5",
    ("plain", 1): "bcd84853489a2903e6efa6c96d175b5f00ee32c98b105bb8801ff63144f9b34d",
    ("mixed", 0): "a0c95886df01baaf8feb0a6fded72abd04b2df7bf38d3a8699ca5379db075efa",
    ("mixed", 1): "b859dbfc6470acbbef5c29ec2c76d129c53c065c2b3582191c6f129b81a57c8f",
    ("mixed-rules", 0): "da08ad620746f145bc3af820000f612b6b541aca79162aa58e99bac45161c76d",
    ("mixed-rules", 1): "d5c7eeade44687be3ca7b2acd7cb8e8c70d0390106dbd45662e6582be71ebfd6",
}


@pytest.mark.parametrize("case", sorted(GOLDEN))
@pytest.mark.parametrize("walk", [False, True], ids=["flatten_state", "StateWalk"])
def test_the_fingerprint_of_a_fixed_state_never_drifts(case: tuple[str, int], walk: bool) -> None:
    kind, rank = case
    state = plain_state() if kind == "plain" else mixed_state()
    rules, coords = (LayoutRules(RULES), RankCoords(rank, 2)) if kind == "mixed-rules" else (None, None)
    flat = StateWalk().flatten(state, rank=rank) if walk else flatten_state(state, rank=rank, validate=False)
    assert StructureCache().for_state(flat, rules, coords).fingerprint == GOLDEN[case]
