"""Expert- and pipeline-parallel re-layout, with TP and DP in one layout, FP8 among the tensors
(issue 31 items 3 and 4): saved by 4 gloo ranks (EP=4, PP=4, PP2 x EP2, a (dp 2, tp 2) mesh),
loaded by 2 and by 1, every tensor byte for byte, every expert present, through the plain
client and through torch.distributed.checkpoint. The scenarios: tests/integration/layouts_rank.py."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.layout import Expert, LayoutError, LayoutRules, RankCoords, Rule, StoredAs
from ckptd.offline import open_step

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from worker_process import run_ranks  # noqa: E402

SCRIPT = HERE / "layouts_rank.py"
E = 4


# issue 31 item 3 (EP, PP, TP x DP x EP) and item 4 (FP8 weights, scales and optimizer state)
def test_moe_and_pipeline_layouts_saved_at_four_ranks_load_at_two_and_one(daemon, tmp_path: Path) -> None:
    run_ranks(SCRIPT, 4, mode="save", address=daemon.address, out=str(tmp_path))
    for job in ("ep", "ppep"):  # every expert of every layer stored under its global name: none dropped
        names = {t.name for t in open_step(daemon.root / job / "step-00000001").index.tensors}
        for layer in range(4):
            for e in range(E):
                assert f"model/layers.{layer}.moe.experts.{e}.w1" in names, (job, layer, e)
                assert f"optimizer/state/layers.{layer}.moe.experts.{e}.w1/exp_avg" in names, (job, layer, e)
        assert not any(".experts.4." in n for n in names)
        assert "model/lm_head.weight" not in names  # the last stage's copy is the embedding, stored once
    names = {t.name for t in open_step(daemon.root / "pp-dcp" / "step-00000001").index.tensors}
    assert {f"model/moe.experts.{e}.w1" for e in range(E)} <= names and "model/embed.weight" in names
    fp8 = {t.name: t.dtype for t in open_step(daemon.root / "dt" / "step-00000001").index.tensors}
    assert fp8["model/layers.0.moe.w1_fp8"] == "F8_E4M3" and fp8["optimizer/state.layers.0.moe.w1.exp_avg_fp8"] == "F8_E5M2"
    for world in (2, 1):
        run_ranks(SCRIPT, world, mode="load", address=daemon.address, out=str(tmp_path), root=str(daemon.root))


# issue 31 item 3: a save that would keep one rank's experts is refused
def test_an_expert_index_outside_the_ranks_share_is_refused(daemon) -> None:
    rules = LayoutRules([Rule(r"experts\.(\d+)\.w", Expert(num_experts=4))])
    # rank 0 of EP=2 with all 4 experts under local indices: a mistaken ep_size; never saved as a replica
    state = {"model": {f"experts.{i}.w": torch.ones(2) for i in range(4)}}
    with CheckpointClient("ep-bad", address=daemon.address, on_error="raise", layout=rules, coords=RankCoords(0, 1, ep_rank=0, ep_size=2)) as ckpt:
        with pytest.raises(LayoutError, match="local expert index '2'.*holds 2 of the 4 experts"):
            ckpt.save(1, state)
    with pytest.raises(ValueError, match="exactly one capturing group"):
        LayoutRules([Rule(r"experts\.\d+\.w", Expert(num_experts=4))])
    with pytest.raises(ValueError, match="ep_rank < ep_size"):
        RankCoords(0, 1, ep_rank=2, ep_size=2)
    clash = {"model": {"lm_head.weight": torch.ones(2), "embed.weight": torch.zeros(2)}}
    with CheckpointClient("pp-bad", address=daemon.address, on_error="raise", layout=LayoutRules([Rule(r"lm_head\.weight", StoredAs("embed.weight"))]), coords=RankCoords(0, 1)) as ckpt:
        with pytest.raises(LayoutError, match="also holds 'model/embed.weight'"):
            ckpt.save(1, clash)


def test_plain_dicts_saved_by_two_pipeline_ranks_load_whole_into_one_rank(daemon) -> None:
    """Each stage saves a plain dict of its own layers; one rank loads both: every layer is in
    the dict after the load (a rank's tree names only its own layers; the dict was cleared and
    refilled from rank 0's, dropping layer 1 though its values had been filled)."""
    states = {rank: {"model": {f"layer{rank}.w": torch.full((4,), rank + 1.0)}} for rank in (0, 1)}
    errors: list[BaseException] = []

    def save(rank: int) -> None:
        try:
            with CheckpointClient("pp-dicts", address=daemon.address, rank=rank, world_size=2, on_error="raise") as ckpt:
                ckpt.save(1, states[rank]).wait_durable(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    stages = [threading.Thread(target=save, args=(rank,)) for rank in (0, 1)]
    for stage in stages:
        stage.start()
    for stage in stages:
        stage.join()
    assert errors == []
    whole = {"model": {"layer0.w": torch.zeros(4), "layer1.w": torch.zeros(4)}}
    with CheckpointClient("pp-dicts", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.load(whole) == 1
    assert list(whole["model"]) == ["layer0.w", "layer1.w"]
    assert torch.equal(whole["model"]["layer0.w"], torch.full((4,), 1.0)) and torch.equal(whole["model"]["layer1.w"], torch.full((4,), 2.0))
