"""The demo's model and corpus: deterministic, and it really learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptd.demo.charlm import (
    CharLM,
    CharLMConfig,
    batch_at,
    batches,
    evaluate,
    lm_loss,
    load_corpus,
    split_corpus,
    stdlib_sources,
)

SMALL = CharLMConfig(d_model=32, n_heads=2, n_layers=1, context=16)


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_corpus(max_bytes=200_000)


def test_corpus_is_the_stdlib_in_sorted_order(corpus: bytes) -> None:
    assert len(corpus) == 200_000
    assert load_corpus(max_bytes=200_000) == corpus
    files = stdlib_sources()
    assert files == sorted(files)
    assert not any(part in {"site-packages", "test", "tests"} for f in files for part in f.parts)
    assert corpus.startswith(files[0].read_bytes()[:1000])


def test_corpus_without_sources_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.py files"):
        load_corpus(stdlib=tmp_path)


def test_split_keeps_every_byte(corpus: bytes) -> None:
    train, held_out = split_corpus(corpus, held_out_fraction=0.1)
    assert train.dtype == held_out.dtype == torch.uint8
    assert len(held_out) == 20_000
    assert bytes(torch.cat([train, held_out]).tolist()) == corpus


def test_init_depends_on_the_seed_only() -> None:
    torch.manual_seed(123)
    a = CharLM(SMALL, seed=7).state_dict()
    torch.manual_seed(456)
    b = CharLM(SMALL, seed=7).state_dict()
    c = CharLM(SMALL, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.qkv.weight"], c["blocks.0.qkv.weight"])


def test_tied_embeddings_share_one_tensor() -> None:
    tied = CharLM(SMALL)
    assert tied.head.weight is tied.embed.weight
    untied = CharLM(CharLMConfig(d_model=32, n_heads=2, n_layers=1, context=16, tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight


def test_batch_of_a_step_is_a_pure_function(corpus: bytes) -> None:
    train, _ = split_corpus(corpus)
    stream = batches(train, 4, 16, seed=3, rank=1, world_size=2)
    run = [next(stream) for _ in range(6)]
    resumed = batches(train, 4, 16, seed=3, rank=1, world_size=2, start_step=4)
    for step, x, y in (next(resumed), next(resumed)):
        assert step == run[step][0]
        assert torch.equal(x, run[step][1]) and torch.equal(y, run[step][2])
    x, y = run[0][1], run[0][2]
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    # The ranks' batches are the two halves of the global batch.
    global_x, _ = batch_at(train, 8, 16, seed=3, step=0)
    assert torch.equal(global_x[4:], x)
    assert not torch.equal(batch_at(train, 4, 16, seed=3, step=0, rank=0, world_size=2)[0], x)


def test_loss_goes_down_in_thirty_steps(corpus: bytes) -> None:
    torch.manual_seed(0)
    train, held_out = split_corpus(corpus)
    model = CharLM(SMALL, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = evaluate(model, held_out, SMALL.context, n_batches=2)
    for step, x, y in batches(train, 8, SMALL.context, seed=0):
        if step == 30:
            break
        opt.zero_grad()
        lm_loss(model, x, y).backward()
        opt.step()
    after = evaluate(model, held_out, SMALL.context, n_batches=2)
    assert before > 5.0  # about ln(256) at the start
    assert after < before - 1.0
    assert evaluate(model, held_out, SMALL.context, n_batches=2) == after
    assert model.training


def test_too_long_a_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than the model's context"):
        CharLM(SMALL)(torch.zeros(1, 17, dtype=torch.long))
