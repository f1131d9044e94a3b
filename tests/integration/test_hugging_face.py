"""A Hugging Face model saved through ckptd loads with `from_pretrained` from the step directory."""

from __future__ import annotations

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.demo.process import DaemonProcess

transformers = pytest.importorskip("transformers")


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


@pytest.mark.parametrize("tied", [True, False])
def test_llama_step_dir_loads_with_from_pretrained(daemon, tied: bool) -> None:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    opt.step()

    with CheckpointClient(f"llama-{tied}", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(1, {"model": model, "optimizer": opt}).wait_durable(timeout=60)

    loaded = transformers.LlamaForCausalLM.from_pretrained(info.step_dir).eval()
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


class _Adapter(torch.nn.Module):
    """A model that names its own model files, as ckptd.integrations.peft's adapter view does."""

    def __init__(self) -> None:
        super().__init__()
        self.lora_A = torch.nn.Linear(8, 2, bias=False)
        self.lora_B = torch.nn.Linear(2, 8, bias=False)

    def ckptd_model_files(self) -> dict[str, str]:
        return {"adapter_config.json": '{"peft_type": "LORA", "r": 2}'}


def test_a_model_with_adapter_config_gets_the_file_peft_reads(daemon) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    model = _Adapter()
    with CheckpointClient("adapter", address=daemon.address, on_error="raise") as ckpt:
        info = ckpt.save(3, {"model": model}).wait_durable(timeout=60)
    step_dir = Path(info.step_dir)
    assert json.loads((step_dir / "adapter_config.json").read_text())["r"] == 2
    assert not (step_dir / "config.json").exists()
    adapter = load_file(step_dir / "adapter_model.safetensors")
    assert set(adapter) == {"lora_A.weight", "lora_B.weight"}
    assert torch.equal(adapter["lora_A.weight"], model.lora_A.weight.detach())
    model_file = next(step_dir.glob("model-*.safetensors"))
    assert (step_dir / "adapter_model.safetensors").read_bytes() == model_file.read_bytes()
    index = json.loads((step_dir / "ckptd.index.json").read_text())
    assert index["files"]["adapter_model.safetensors"]["checksum"] == index["files"][model_file.name]["checksum"]
    verified = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "verify", str(step_dir)], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_ckptd_model_files_must_return_names_and_text(daemon) -> None:
    class Bad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def ckptd_model_files(self) -> object:
            return {"adapter_config.json": b"{}"}

    with CheckpointClient("bad-files", address=daemon.address, on_error="raise") as ckpt:
        with pytest.raises(TypeError, match="ckptd_model_files"):
            ckpt.save(1, {"model": Bad()})


def test_each_step_records_its_environment_and_inspect_shows_it(daemon) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    model = torch.nn.Linear(4, 3)
    run_config = {"lr": 3e-4, "data": "shard-*.bin", "layers": [4, 3]}
    with CheckpointClient("env", address=daemon.address, on_error="raise", run_config=run_config) as ckpt:
        info = ckpt.save(7, {"model": model}).wait_durable(timeout=60)
    env = json.loads((Path(info.step_dir) / "environment.json").read_text())
    assert env["trainer"]["torch"] == torch.__version__
    assert env["trainer"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["trainer"]["run_config"] == run_config
    assert env["layout"]["world_size"] == 1 and env["layout"]["ranks_per_node"] == [1]
    assert env["layout"]["kinds"]["model"]["tensors"] == 2
    shown = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", info.step_dir], capture_output=True, text=True, check=True).stdout
    assert f"torch {torch.__version__}" in shown and "world size 1 on 1 nodes" in shown and '"lr": 0.0003' in shown
    as_json = json.loads(subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "inspect", "--json", info.step_dir], capture_output=True, text=True, check=True).stdout)
    assert as_json["environment"] == env


@pytest.mark.parametrize("bad", [[1, 2], {"f": object()}, {"x": float("nan")}])
def test_a_run_config_that_is_not_a_json_dict_is_refused(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="run_config"):
        CheckpointClient("env", address="unix:///nonexistent.sock", run_config=bad)  # type: ignore[arg-type]
