"""Adapter-only checkpoints (ckptd.integrations.peft.adapter_state) of a LoRA fine-tune run by
gloo ranks as processes against a real daemon (peft_ranks.py): under DDP killed with SIGKILL and
resumed exactly; under FSDP2, HSDP and tensor parallel (DTensor adapters) saved by every rank
and loaded bit-exact at one rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")
pytest.importorskip("transformers")

from worker_process import run_ranks, run_ranks_until_killed  # noqa: E402  tests/worker_process.py

SCRIPT = Path(__file__).with_name("peft_ranks.py")


def _index(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "ckptd.index.json").read_text())


def _step_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted({f["file"] for t in _index(step_dir)["tensors"].values() for f in t["fragments"]})
    return {k: v for name in files for k, v in load_file(step_dir / name).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(v, b[k]) for k, v in a.items())


# issue 31 item 1 (PEFT x DDP)
@pytest.mark.long
def test_a_ddp_lora_fine_tune_killed_mid_run_resumes_exactly(daemon, tmp_path: Path) -> None:
    """Two DDP ranks save the adapter every 2 steps; rank 0 SIGKILLs itself in step 5, after
    step 4 was durable; two fresh ranks resume from step 4. Their losses, and the last step's
    adapter, optimizer state and RNG, equal an uninterrupted run's bit for bit."""
    steps = 8

    def spec(job: str, name: str) -> dict[str, Any]:
        (tmp_path / name).mkdir()
        return {"layout": "ddp", "mode": "train", "address": daemon.address, "job": job, "steps": steps, "save_every": 2, "out": str(tmp_path / name)}

    run_ranks(SCRIPT, 2, **spec("reference", "reference"))
    run_ranks_until_killed(SCRIPT, 2, victim=0, **spec("lora", "killed"), kill_at=4)
    assert not (tmp_path / "killed" / "losses.json").exists()
    run_ranks(SCRIPT, 2, **spec("lora", "resumed"))

    want = json.loads((tmp_path / "reference" / "losses.json").read_text())
    got = json.loads((tmp_path / "resumed" / "losses.json").read_text())
    assert got["start"] == 4
    assert got["losses"] == {k: v for k, v in want["losses"].items() if int(k) > 4}  # exact floats
    assert _same(load_file(tmp_path / "resumed" / "held.safetensors"), load_file(tmp_path / "reference" / "held.safetensors"))

    last = f"step-{steps:08d}"
    mine, theirs = _step_tensors(daemon.root / "lora" / last), _step_tensors(daemon.root / "reference" / last)
    assert any(k.startswith("optimizer/") for k in mine) and any(k.startswith("rng/rank1/") for k in mine)
    assert not any("base_layer" in k or "embed_tokens" in k for k in mine)  # the adapter only
    assert _same(mine, theirs)


# issue 31 item 1 (PEFT x FSDP2, PEFT x HSDP); FSDP2 is the default run's test of adapter_state over several ranks
@pytest.mark.parametrize(("layout", "placements"), [("fsdp2", ["S(0)"]), pytest.param("hsdp", ["R", "S(0)"], marks=pytest.mark.long)])
def test_sharded_dtensor_adapters_are_saved_and_load_whole_at_one_rank(daemon, tmp_path: Path, layout: str, placements: list[str]) -> None:
    """fully_shard over 2 ranks (FSDP2: Shard(0) over 2; HSDP: 2 replicas of 1 shard) makes the
    LoRA matrices and their Adam state DTensors; the adapter-only step holds only them (no base
    weight), each rank handing over its own part, and one rank with a plain (unsharded)
    PeftModel loads it bit-exact: adapter, optimizer state, scheduler."""
    steps = 3
    for name in ("sharded", "whole"):
        (tmp_path / name).mkdir()
    common = {"address": daemon.address, "job": "fsdp2", "steps": steps, "save_every": steps}
    run_ranks(SCRIPT, 2, layout=layout, mode="train", out=str(tmp_path / "sharded"), **common)
    run_ranks(SCRIPT, 1, layout="none", mode="load", out=str(tmp_path / "whole"), **common)

    index = _index(daemon.root / "fsdp2" / f"step-{steps:08d}")
    model = {name: t for name, t in index["tensors"].items() if t["kind"] == "model"}
    assert model and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in model)  # the adapter only
    held_as = json.loads((tmp_path / "sharded" / "placements.json").read_text())
    assert sorted(f"model/{key}" for key in held_as) == sorted(model)
    assert all(p == placements for p in held_as.values()), held_as  # DTensors: what each rank handed over was its part
    assert json.loads((tmp_path / "whole" / "placements.json").read_text()) == dict.fromkeys(held_as)  # plain tensors

    saved, loaded = load_file(tmp_path / "sharded" / "held.safetensors"), load_file(tmp_path / "whole" / "held.safetensors")
    assert any(k.endswith("/exp_avg_sq") for k in saved)
    assert _same(loaded, saved)
    assert json.loads((tmp_path / "whole" / "lr.json").read_text()) == json.loads((tmp_path / "sharded" / "lr.json").read_text())


# issue 31 item 1 (PEFT x TP)
@pytest.mark.long
def test_tensor_parallel_lora_is_saved_and_loads_whole_at_one_rank(daemon, tmp_path: Path) -> None:
    """TP over 2 ranks (peft_ranks.tensor_parallel: lora_B a Shard(0) DTensor, split like its
    base layer's output; lora_A whole on every rank): the adapter-only step loads bit-exact into
    a plain PeftModel at one rank, adapter, optimizer state and scheduler."""
    steps = 3
    for name in ("sharded", "whole"):
        (tmp_path / name).mkdir()
    common = {"address": daemon.address, "job": "tp", "steps": steps, "save_every": steps}
    run_ranks(SCRIPT, 2, layout="tp", mode="train", out=str(tmp_path / "sharded"), **common)
    run_ranks(SCRIPT, 1, layout="none", mode="load", out=str(tmp_path / "whole"), **common)

    held_as = json.loads((tmp_path / "sharded" / "placements.json").read_text())
    assert {k: p for k, p in held_as.items() if ".lora_B." in k} == {k: ["S(0)"] for k in held_as if ".lora_B." in k}
    assert {k: p for k, p in held_as.items() if ".lora_A." in k} == {k: None for k in held_as if ".lora_A." in k}
    saved, loaded = load_file(tmp_path / "sharded" / "held.safetensors"), load_file(tmp_path / "whole" / "held.safetensors")
    assert any(k.endswith("/exp_avg_sq") and ".lora_B." in k for k in saved)
    assert _same(loaded, saved)
    assert json.loads((tmp_path / "whole" / "lr.json").read_text()) == json.loads((tmp_path / "sharded" / "lr.json").read_text())
