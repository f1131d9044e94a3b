"""Training in each parallel layout through the plain client, SIGKILLed mid-run and resumed
(issue 31, "Must show": for each strategy, killed mid-run, resumed in the same and in another
world size, losses identical to an uninterrupted run).

Gloo ranks as processes (train_layouts_rank.py: FSDP2, HSDP, TP, PP through
torch.distributed.pipelining with a tied embedding across the first and last stage, EP with
experts under local indices), a real daemon, saves after every
step. Rank 1 waits until step 2 is durable and SIGKILLs itself right after its save of step 3
returns (the bytes copied, the commit that hands them over in flight); the others are then SIGKILLed, as
torchrun's agent stops a group. The group is started again at the same world size: it loads the
daemon's newest committed step (2, or 3 if its commit got through) and trains to the end. Checked:

- every step's loss, in the killed run and in the resumed one, equals an uninterrupted run's bit
  for bit, and so does the final model and optimizer state (the resumed ranks train a fresh model
  without ckptd afterwards, for the reference);
- the final step's index holds exactly the model's and optimizer's tensors by stored name (every
  expert under its global index, the tied output layer stored once as the embedding);
- the final step loads into another layout and world size (PP 2 -> 1, EP 2 -> 1; *long*: PP 4 -> 2,
  EP 4 -> 2, EP with DTensor experts 2 -> 1, TP 2 -> 1, HSDP 2x2 -> FSDP2 over 2, FSDP2 2 -> 1): every tensor of the model and the
  optimizer, by its stored name, equals the saved one bit for bit, none missing, none extra; one
  more step trained there gives the loss of the uninterrupted run's next step up to float
  reduction order (exactly where the layout computes in the same order).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptd.offline import open_step

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from worker_process import run_ranks, run_ranks_until_killed  # noqa: E402

SCRIPT = HERE / "train_layouts_rank.py"
STEPS, KILL_AFTER, VICTIM = 4, 2, 1


def merged(out: Path, pattern: str) -> dict[str, torch.Tensor]:
    """The tensors the ranks' files hold, by stored name; a name held by several ranks (a
    replica, a tied copy) must be the same on each."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob(pattern)):
        for name, t in load_file(str(path)).items():
            if name in tensors:
                assert torch.equal(tensors[name], t), f"{name} differs between ranks ({path.name})"
            tensors[name] = t
    return tensors


CASES = [
    pytest.param("pp", 2, "pp", 1, True, id="pp-2-then-1"),
    pytest.param("ep", 2, "ep", 1, False, id="ep-2-then-1"),
    pytest.param("pp", 4, "pp", 2, True, id="pp-4-then-2", marks=pytest.mark.long),
    pytest.param("ep", 4, "ep", 2, False, id="ep-4-then-2", marks=pytest.mark.long),
    pytest.param("ep-dtensor", 2, "ep-dtensor", 1, False, id="ep-dtensor-2-then-1", marks=pytest.mark.long),
    pytest.param("tp", 2, "tp", 1, False, id="tp-2-then-1", marks=pytest.mark.long),
    pytest.param("hsdp", 4, "fsdp2", 2, False, id="hsdp-2x2-then-fsdp2-2", marks=pytest.mark.long),
    pytest.param("fsdp2", 2, "fsdp2", 1, False, id="fsdp2-2-then-1", marks=pytest.mark.long),
]


# issue 31 item 1 (FSDP2, HSDP, TP) and item 3 (PP, EP): "Must show" SIGKILL and resume per strategy
@pytest.mark.slow
@pytest.mark.parametrize("strategy, world, other, other_world, same_order", CASES)
def test_killed_mid_run_resumes_with_identical_losses_then_loads_in_another_layout(
    daemon, tmp_path: Path, strategy: str, world: int, other: str, other_world: int, same_order: bool
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    common = {"address": daemon.address, "job": f"train-{strategy}", "steps": STEPS, "out": str(out)}
    run_ranks_until_killed(SCRIPT, world, VICTIM, strategy=strategy, mode="train", kill={"rank": VICTIM, "step": KILL_AFTER}, **common)
    first = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first][:KILL_AFTER] == list(range(1, KILL_AFTER + 1)) and len(first) <= KILL_AFTER + 1, first

    run_ranks(SCRIPT, world, strategy=strategy, mode="train", reference=True, **common)
    records = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    reference = {int(step): loss for step, loss in json.loads((out / "reference.json").read_text()).items()}
    resumed = records[len(first) :]
    start = resumed[0]["resumed_from"]
    assert start in (KILL_AFTER, KILL_AFTER + 1), resumed  # the newest durable step: 2, or 3 if its commit got through
    assert [r["step"] for r in resumed] == list(range(start + 1, STEPS + 1)) and {r["resumed_from"] for r in resumed} == {start}
    for r in records:
        assert r["loss"] == reference[r["step"]], (r, reference)  # bit for bit, the killed run's steps and the resumed run's
    saved, uninterrupted = merged(out, "saved-*.safetensors"), merged(out, "reference-*.safetensors")
    assert sorted(saved) == sorted(uninterrupted)
    for name, t in uninterrupted.items():  # the resumed run ends where the uninterrupted one does, bit for bit
        assert torch.equal(saved[name], t), name
    # the step holds exactly these tensors, each once by its stored name: every expert under its
    # global index, the last stage's output layer as the embedding it is tied to
    index = open_step(daemon.root / common["job"] / f"step-{STEPS:08d}").index
    names = sorted(t.name for t in index.tensors)
    assert names == sorted(saved)
    assert strategy != "ep" or {f"model/experts.{e}.0.weight" for e in range(4)} <= set(names)
    assert strategy != "pp" or ("model/embed.weight" in names and not any("lm_head" in n for n in names))

    run_ranks(SCRIPT, other_world, strategy=other, mode="check", **common)
    loaded = merged(out, "loaded-*.safetensors")
    assert sorted(loaded) == sorted(saved)  # every tensor (every expert, the tied embedding): none dropped, none extra
    for name, t in saved.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    next_loss = json.loads((out / "next_loss.json").read_text())
    if same_order:  # the stages compute the same micro-batches in the same order at any PP size
        assert next_loss == reference[STEPS + 1]
    else:  # the gradient and loss reductions sum in another order over another number of ranks
        assert next_loss == pytest.approx(reference[STEPS + 1], rel=1e-5)
