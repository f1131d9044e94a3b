"""Adapter-only checkpoints of PEFT models (ckptd.integrations.peft), with the real peft and
transformers on CPU and real daemons: what a step holds, in-place loads, PeftModel.from_pretrained
of a step directory, an exact resume of a LoRA fine-tune killed with SIGKILL, and misuse."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from worker_process import load_worker  # tests/worker_process.py
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ckptd.client import CheckpointClient
from ckptd.demo.process import DaemonProcess

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from ckptd.integrations.peft import ADAPTER_CONFIG_NAME, AdapterModel, adapter_config_json, adapter_state  # noqa: E402

WORKER = Path(__file__).with_name("peft_train.py")


train = load_worker(WORKER)


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


def _trained(steps: int = 3, **lora: Any) -> tuple[Any, torch.optim.Optimizer, Any]:
    """A LoRA model trained `steps` steps (no dropout, so eval outputs are comparable)."""
    model = train.lora_model(lora_dropout=0.0, **lora)
    optimizer, scheduler = train.optimizer_and_scheduler(model, 10)
    for step in range(1, steps + 1):
        train.train_step(model, optimizer, scheduler, step)
    return model, optimizer, scheduler


def _index(step_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(step_dir) / "ckptd.index.json").read_text())


def _adapter_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------ the view


def test_adapter_model_holds_the_live_adapter_tensors_under_the_keys_peft_saves() -> None:
    model, optimizer, _ = _trained()
    adapter = AdapterModel(model)
    saved_by_peft = peft.get_peft_model_state_dict(model)
    state = adapter.state_dict()
    assert list(state) == list(saved_by_peft) == list(adapter.adapter_keys)
    assert all(".default." not in key and "base_layer" not in key for key in state)
    trainable = _adapter_params(model).values()
    assert {state[k].data_ptr() for k in state} == {p.data_ptr() for p in trainable}  # views, nothing copied
    assert {id(p) for p in adapter.parameters()} == {id(p) for p in trainable}
    assert {k: torch.equal(v, saved_by_peft[k]) for k, v in state.items()} == dict.fromkeys(state, True)

    # torch.distributed.checkpoint names the optimizer state through the view: by PEFT key
    optim_state = get_optimizer_state_dict(adapter, optimizer)
    assert sorted(optim_state["state"]) == sorted(state)
    assert set(optim_state["state"][adapter.adapter_keys[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sorted(optim_state["param_groups"][0]["params"]) == sorted(state)


def test_adapter_config_json_is_what_save_pretrained_writes(tmp_path: Path) -> None:
    model, _, _ = _trained(steps=0, modules_to_save=["lm_head"])
    ours = json.loads(adapter_config_json(model))
    model.save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / ADAPTER_CONFIG_NAME).read_text())
    theirs["target_modules"] = sorted(theirs["target_modules"])  # a set, written in the set's order
    assert ours == theirs
    assert ours["inference_mode"] is True
    assert AdapterModel(model).ckptd_model_files() == {ADAPTER_CONFIG_NAME: adapter_config_json(model)}


def test_another_adapter_of_the_model_is_saved_by_name() -> None:
    model = train.lora_model()
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["k_proj"]))
    adapter = AdapterModel(model, adapter_name="other")
    assert adapter.adapter_keys == tuple(peft.get_peft_model_state_dict(model, adapter_name="other"))
    assert all(".k_proj.lora_" in key for key in adapter.adapter_keys)
    assert json.loads(adapter.ckptd_model_files()[ADAPTER_CONFIG_NAME])["r"] == 2


def test_wrappers_around_the_peft_model_are_seen_through() -> None:
    model = train.lora_model()
    compiled = torch.compile(model)  # compiles at its first call: none here
    assert AdapterModel(compiled).adapter_keys == AdapterModel(model).adapter_keys
    assert AdapterModel(compiled).peft_model is model


# ------------------------------------------------------------------ through a daemon


@pytest.mark.parametrize("lora", [{}, {"modules_to_save": ["lm_head"]}], ids=["lora", "modules_to_save"])
def test_a_step_holds_only_the_adapter_and_loads_in_place(daemon, lora: dict[str, Any]) -> None:
    model, optimizer, scheduler = _trained(**lora)
    state = adapter_state(model, optimizer, scheduler)
    keys = state["model"].adapter_keys
    with CheckpointClient("-".join(["adapter", *lora]), address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(3, state).wait_durable(timeout=60)
        assert info is not None

        index = _index(info.step_dir)
        model_tensors = {name for name, t in index["tensors"].items() if t["kind"] == "model"}
        assert model_tensors == {f"model/{key}" for key in keys}  # no base weight
        optim_fqns = {name.split("/")[2] for name, t in index["tensors"].items() if t["kind"] == "optimizer"}
        assert optim_fqns == set(keys)
        model_files = {f["file"] for name in model_tensors for f in index["tensors"][name]["fragments"]}
        assert len(model_files) == 1
        (model_file,) = model_files
        with safe_open(Path(info.step_dir) / model_file, "pt") as data:
            assert sorted(data.keys()) == sorted(keys)  # PEFT's keys, nothing else
        whole_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        fraction = index["files"][model_file]["size"] / whole_bytes
        assert fraction < (0.3 if lora else 0.05), fraction  # lm_head is a quarter of this tiny model

        saved = {n: p.detach().clone() for n, p in _adapter_params(model).items()}
        saved_optim = {k: {f: v.clone() for f, v in s.items()} for k, s in get_optimizer_state_dict(state["model"], optimizer)["state"].items()}
        saved_lr = scheduler.get_last_lr()
        for step in range(4, 6):  # the training goes on, then is rolled back by the load
            train.train_step(model, optimizer, scheduler, step)
        assert ckpt.load(state) == 3

    assert {n: torch.equal(p, saved[n]) for n, p in _adapter_params(model).items()} == dict.fromkeys(saved, True)
    loaded_optim = get_optimizer_state_dict(state["model"], optimizer)["state"]
    assert {k: all(torch.equal(v, saved_optim[k][f]) for f, v in s.items()) for k, s in loaded_optim.items()} == dict.fromkeys(keys, True)
    assert scheduler.get_last_lr() == saved_lr


@pytest.mark.parametrize(
    "lora", [{}, {"modules_to_save": ["lm_head"]}, {"use_dora": True}], ids=["lora", "modules_to_save", "dora"]
)
def test_the_step_directory_loads_with_peft_from_pretrained(daemon, lora: dict[str, Any]) -> None:
    model, optimizer, scheduler = _trained(**lora)
    with CheckpointClient("-".join(["from-pretrained", *lora]), address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(3, adapter_state(model, optimizer, scheduler)).wait_durable(timeout=60)
    assert info is not None
    loaded = peft.PeftModel.from_pretrained(train.tiny_llama(), info.step_dir).eval()
    tokens = train.batch(99)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model.eval()(tokens).logits)


@pytest.mark.slow
def test_a_fine_tune_killed_after_a_durable_save_resumes_exactly(daemon, tmp_path: Path) -> None:
    """peft_train.py runs a fine-tune that is SIGKILLed after its save of step 6 is durable, then
    one that starts from a fresh model, loads that step and trains on; its losses, and its final
    adapter and optimizer state, equal those of an uninterrupted run (in this process, as the
    trainer is killed: the same code and thread count, so the same arithmetic)."""
    stop, every = 12, 3

    def spec(job: str, name: str, **more: Any) -> dict[str, Any]:
        return {"address": daemon.address, "job": job, "stop": stop, "save_every": every, "out": str(tmp_path / f"{name}.json"), **more}

    def start(spec: dict[str, Any]) -> subprocess.Popen[bytes]:
        with open(Path(spec["out"]).with_suffix(".log"), "wb") as log:  # a file: a full pipe would block the trainer
            return subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], stdout=log, stderr=subprocess.STDOUT)

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]

    marker = tmp_path / "durable"
    killed = start(spec("lora", "killed", last_save=6, marker=str(marker)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.run(spec("reference", "reference"))
    finally:
        torch.set_num_threads(threads)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert killed.poll() is None, log("killed")
        assert time.monotonic() < deadline, "the trainer never reported a durable save"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(60) == -signal.SIGKILL, log("killed")

    resumed = start(spec("lora", "resumed", resume=True))
    assert resumed.wait(120) == 0, log("resumed")

    want = json.loads((tmp_path / "reference.json").read_text())
    got = json.loads((tmp_path / "resumed.json").read_text())
    assert got["start"] == 6
    assert got["losses"] == {k: v for k, v in want["losses"].items() if int(k) > 6}  # exact floats

    # the last step of both jobs: the same adapter and optimizer tensors, bit for bit
    def tensors(job: str) -> dict[str, torch.Tensor]:
        step_dir = daemon.root / job / f"step-{stop:08d}"
        index = _index(step_dir)
        files = sorted({f["file"] for t in index["tensors"].values() for f in t["fragments"]})
        return {k: v for name in files for k, v in load_file(step_dir / name).items()}

    mine, theirs = tensors("lora"), tensors("reference")
    assert sorted(mine) == sorted(theirs) and any(k.startswith("optimizer/") for k in mine)
    assert {k: torch.equal(v, theirs[k]) for k, v in mine.items()} == dict.fromkeys(mine, True)


# ------------------------------------------------------------------ misuse


def test_a_model_that_is_not_a_peft_model_is_refused() -> None:
    with pytest.raises(TypeError, match=r"needs a peft.PeftModel, got LlamaForCausalLM: make one with peft.get_peft_model"):
        adapter_state(train.tiny_llama())
    injected = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]), train.tiny_llama())
    with pytest.raises(TypeError, match="has adapter layers but no PeftModel around them"):
        AdapterModel(injected)


def test_an_optimizer_over_more_than_the_adapter_is_refused() -> None:
    model = train.lora_model()
    with pytest.raises(ValueError, match=r"updates 21 parameter\(s\) that are not tensors of adapter 'default': 'base_model.model.model.embed_tokens.weight'"):
        adapter_state(model, torch.optim.AdamW(model.parameters()))
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["k_proj"]))
    other = [p for n, p in model.named_parameters() if ".other." in n]
    mixed = torch.optim.AdamW([*_adapter_params(model).values(), *other])
    with pytest.raises(ValueError, match=r"'base_model.model.model.layers.0.self_attn.k_proj.lora_A.other.weight'"):
        adapter_state(model, mixed)
    stranger = torch.optim.SGD([*_adapter_params(model).values(), torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"a parameter of shape \[3\] that is not in the PeftModel"):
        adapter_state(model, stranger)


def test_other_misuse_is_refused_with_what_to_do() -> None:
    model = train.lora_model()
    with pytest.raises(ValueError, match=r"has no adapter 'nope'; its adapters are \['default'\]"):
        AdapterModel(model, adapter_name="nope")
    with pytest.raises(ValueError, match="save_embedding_layers='yes'"):
        AdapterModel(model, save_embedding_layers="yes")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        adapter_state(model, list(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scheduler must have state_dict"):
        adapter_state(model, None, scheduler=0.5)
    with pytest.raises(RuntimeError, match="run the PeftModel itself"):
        AdapterModel(model)(train.batch(0))
    prompt = peft.get_peft_model(train.tiny_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"PROMPT_TUNING\) with tensors computed from the model.*'prompt_embeddings'"):
        AdapterModel(prompt)


# a new user's probe, 2026-12-01: the HF callback saved a PEFT model's whole state that neither resume path could use
def test_the_trainer_callback_refuses_a_peft_model_when_the_trainer_is_made(daemon, tmp_path: Path) -> None:
    from ckptd.integrations.transformers import CkptdCallback

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    callback = CkptdCallback("peft-trainer", address=daemon.address)
    with pytest.raises(ValueError, match=r"cannot checkpoint a PEFT model through the Trainer: .*ckptd.integrations.peft.adapter_state"):
        transformers.Trainer(model=train.lora_model(), args=args, callbacks=[callback])
