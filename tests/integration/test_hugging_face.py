"""A Hugging Face model saved through ckptd loads with `from_pretrained` from the step directory."""

from __future__ import annotations

import pytest
import torch

from ckptd.client import CheckpointClient

transformers = pytest.importorskip("transformers")


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
