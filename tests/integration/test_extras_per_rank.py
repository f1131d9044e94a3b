"""Issue 30 finding 3: every rank's extras come back to that rank. Real daemons, ranks as gloo
processes (extras_rank.py): each rank saves a tensor, a JSON value and a stateful object's tensor
of its own under extras keys; each loads back its own, and a load by another number of ranks
follows the documented rule (docs/usage.md, extras): a rank the step has gets its own, any other
rank rank 0's; the extras of ranks beyond the loading world are not loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from worker_process import run_ranks  # tests/worker_process.py

from ckptd.client import CheckpointClient
from ckptd.format.index import CheckpointIndex
from ckptd.daemon.importer.importing import import_checkpoint

RANK = Path(__file__).with_name("extras_rank.py")


def _run(daemon, tmp: Path, mode: str, world: int, step: int, job: str = "extras") -> list[dict]:
    out = tmp / f"{mode}-{world}-{step}"
    out.mkdir()
    run_ranks(RANK, world, address=daemon.address, job=job, step=step, mode=mode, out=str(out))
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(world)]


def _own(rank: int) -> dict:
    """What rank `rank` of the save held (extras_rank.state_of)."""
    return {"t": [rank + 1.0] * 4, "r": rank, "position": [100 + rank, 0]}


def _extras(result: dict) -> dict:
    return {k: result[k] for k in ("t", "r", "position")}


@pytest.fixture(scope="module")
def saved(module_daemons, tmp_path_factory: pytest.TempPathFactory):
    """One step saved by 2 ranks, each with extras of its own."""
    daemon = module_daemons.start()
    tmp = tmp_path_factory.mktemp("extras")
    assert [r["step"] for r in _run(daemon, tmp, "save", 2, 1)] == [1, 1]
    return daemon, tmp


def test_issue30_finding3_two_ranks_each_load_back_their_own_extras(saved, module_daemons) -> None:
    daemon, tmp = saved
    loaded = _run(daemon, tmp, "load", 2, 1)
    assert [_extras(r) for r in loaded] == [_own(0), _own(1)]
    index = CheckpointIndex.from_json_bytes((module_daemons.root / "extras" / "step-00000001" / "ckptd.index.json").read_bytes())
    own = {t.name: t.rank for t in index.tensors if t.rank is not None}
    assert own == {"extra/rank0/t": 0, "extra/rank1/t": 1, "sampler/rank0/position": 0, "sampler/rank1/position": 1}
    assert sorted(t.name for t in index.tensors if t.rank is None) == ["model/bias", "model/weight"]  # replicas, stored once


def test_issue30_finding3_more_ranks_than_saved_get_rank_0s_extras(saved) -> None:
    daemon, tmp = saved
    loaded = _run(daemon, tmp, "load", 4, 1)
    assert [_extras(r) for r in loaded] == [_own(0), _own(1), _own(0), _own(0)]


def test_issue30_finding3_fewer_ranks_than_saved_get_their_own_and_the_rest_is_left(saved) -> None:
    daemon, _ = saved
    state = {"extra": {"t": torch.zeros(4), "r": -1}}
    with CheckpointClient("extras", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.load(state, step=1, strict=False) == 1
    assert (state["extra"]["t"].tolist(), state["extra"]["r"]) == ([1.0] * 4, 0)


def test_issue30_finding3_an_extras_tensor_stored_once_for_every_rank_loads_on_every_rank(daemons, tmp_path: Path) -> None:
    """A step whose extras tensor is one tensor of every rank (an import, or a step saved before
    extras were per rank: the index has no rank for it) gives it to every rank."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    source = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "extra": {"t": torch.arange(4.0), "r": 7}}, source)
    import_checkpoint(source, daemons.root, "imported", 3)
    index = CheckpointIndex.from_json_bytes((daemons.root / "imported" / "step-00000003" / "ckptd.index.json").read_bytes())
    assert index.by_name()["extra/t"].rank is None
    daemon = daemons.start()
    for rank in (0, 1):
        state = {"model": torch.nn.Linear(4, 4), "extra": {"t": torch.zeros(4), "r": -1}}
        with CheckpointClient("imported", address=daemon.address, rank=rank, world_size=2, on_error="raise") as ckpt:
            assert ckpt.load(state) == 3
        assert (state["extra"]["t"].tolist(), state["extra"]["r"]) == ([0.0, 1.0, 2.0, 3.0], 7)


# issue 31 item 2 (ckptd.integrations.deepspeed reads its own key first, with strict=False)
def test_a_load_with_strict_false_leaves_a_key_the_step_lacks(saved) -> None:
    daemon, _ = saved
    state = {"extra": {"t": torch.zeros(4), "r": -1}, "absent": {"x": 5}}
    with CheckpointClient("extras", address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        assert ckpt.load(state, step=1, strict=False) == 1
        assert state["absent"] == {"x": 5} and state["extra"]["r"] == 0
        with pytest.raises(ValueError, match="step 1 has no value for 'absent', and nothing was loaded"):
            ckpt.load(state, step=1)
