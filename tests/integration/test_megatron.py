"""Megatron-style manual tensor parallelism: saved at TP=2, restored at TP=1 and TP=4, exact.

Each TP rank is a client of the real daemon (threads of this process, since the save barrier is
the daemon's, not torch.distributed's). The local tensors are built from one global model the
way Megatron shards it: fused QKV with grouped-query sizes, a vocabulary padded for TP, a
row-parallel projection, replicated norms; AdamW moments follow their parameters.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.layout import Fused, LayoutRules, PaddedVocab, RankCoords, Replicated, Rule, Split

HIDDEN, HEAD, N_Q, N_KV, VOCAB = 16, 4, 8, 4, 50
QKV = (N_Q * HEAD, N_KV * HEAD, N_KV * HEAD)


def rules() -> LayoutRules:
    return LayoutRules(
        [
            Rule(r"embed\.weight", PaddedVocab(dim=0, size=VOCAB)),
            Rule(r"layers\.\d+\.qkv\.weight", Fused(dim=0, sizes=QKV)),
            Rule(r"layers\.\d+\.proj\.weight", Split(dim=1)),
            Rule(r"layers\.\d+\.norm\.weight", Replicated(check_equal=False)),
        ]
    )


def global_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "layers.0.qkv.weight": torch.randn(sum(QKV), HIDDEN, generator=g),
        "layers.0.proj.weight": torch.randn(HIDDEN, N_Q * HEAD, generator=g),
        "layers.0.norm.weight": torch.randn(HIDDEN, generator=g),
    }


def local_model(full: dict[str, torch.Tensor], tp: int, r: int) -> dict[str, torch.Tensor]:
    """What TP rank r of `tp` holds, as Megatron lays it out (vocab padded to a multiple of 4 * tp)."""
    padded_rows = -(-VOCAB // (4 * tp)) * 4 * tp
    embed = torch.zeros(padded_rows, HIDDEN)
    embed[:VOCAB] = full["embed.weight"]
    rows = padded_rows // tp
    q, k, v = full["layers.0.qkv.weight"].split(QKV)
    parts = [t.chunk(tp)[r] for t in (q, k, v)]
    return {
        "embed.weight": embed[r * rows : (r + 1) * rows].clone(),
        "layers.0.qkv.weight": torch.cat(parts).clone(),
        "layers.0.proj.weight": full["layers.0.proj.weight"].chunk(tp, dim=1)[r].clone(),
        "layers.0.norm.weight": full["layers.0.norm.weight"].clone(),
    }


def as_ranks(tp: int, job: str, addresses: list[str], action) -> list:
    """Run action(r, client) for TP ranks 0..tp-1; `addresses`: the daemons of the nodes, the
    ranks spread over them in consecutive blocks as torchrun places them."""
    node_of = [r * len(addresses) // tp for r in range(tp)]

    def one(r: int):
        with CheckpointClient(job, address=addresses[node_of[r]], rank=r, world_size=tp, local_world_size=node_of.count(node_of[r]),
                              on_error="raise", layout=rules(), coords=RankCoords(r, tp)) as ckpt:
            return action(r, ckpt)

    with ThreadPoolExecutor(tp) as pool:
        return list(pool.map(one, range(tp)))


@pytest.fixture(params=["one node", "two nodes"])
def addresses(request, daemons, node_sets) -> list[str]:
    """The daemons the ranks talk to: one, or two with node-local roots (each TP rank of the
    TP=2 save on its own node, so the sharded tensors are written as fragments by both)."""
    if request.param == "one node":
        return [daemons.start().address]
    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    return [cluster.address(0), cluster.address(1)]


@pytest.mark.parametrize("load_tp", [1, 4])
def test_tp2_checkpoint_restores_exactly_at_other_tp_sizes(addresses: list[str], load_tp: int) -> None:
    full = global_model()
    moments = {name: t * 0.5 for name, t in full.items()}  # stand-ins for Adam's exp_avg, sharded alike

    def save(r: int, ckpt: CheckpointClient):
        state = {"model": local_model(full, 2, r), "optimizer": {"state": {n: {"exp_avg": t} for n, t in local_model(moments, 2, r).items()}}}
        return ckpt.save(1, state).wait_durable(timeout=60)

    as_ranks(2, f"tp-{load_tp}", addresses, save)

    def load(r: int, ckpt: CheckpointClient):
        model = {name: torch.zeros_like(t) for name, t in local_model(full, load_tp, r).items()}
        moment = {name: {"exp_avg": torch.zeros_like(t)} for name, t in local_model(full, load_tp, r).items()}
        step = ckpt.load({"model": model, "optimizer": {"state": moment}})
        return step, model, moment

    load_on = addresses if load_tp > 1 else addresses[-1:]  # TP=1: the last node, which fetches what others wrote
    for r, (step, model, moment) in enumerate(as_ranks(load_tp, f"tp-{load_tp}", load_on, load)):
        assert step == 1
        expected, expected_m = local_model(full, load_tp, r), local_model(moments, load_tp, r)
        for name in full:
            vocab_rows = slice(None) if name != "embed.weight" else slice(0, max(0, min(VOCAB - r * expected[name].shape[0], expected[name].shape[0])))
            assert torch.equal(model[name][vocab_rows], expected[name][vocab_rows]), (r, name)
            assert torch.equal(moment[name]["exp_avg"][vocab_rows], expected_m[name][vocab_rows]), (r, name)
