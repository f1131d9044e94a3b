"""Flattening a training state into named tensors + JSON extras, and restoring it bit-exactly.

The transport is simulated: every tensor of the saved state is copied into the entry of the
same name of a fresh state's flattening, and the extras go through strict JSON text.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import types
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

from ckptd.client.restore import restore_state
from ckptd.client.state import FlatState, TensorEntry, flatten_state


class Net(nn.Module):
    def __init__(self, tied: bool = False, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, vocab, bias=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seen += tokens.numel()
        return self.head(self.norm(self.body(self.embed(tokens))))


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s),
}


def make_training(seed: int, scheduler: str = "StepLR", tied: bool = False) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, SCHEDULERS[scheduler](opt)


def train_step(model: Net, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
    tokens = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(step))
    logits = model(tokens[:, :-1])  # dropout draws from the global generator
    loss = nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def metadata(flat: FlatState) -> list[tuple]:
    return [(e.name, e.kind, e.tensor.dtype, tuple(e.tensor.shape), e.aliases) for e in flat.tensors]


def transfer(src: FlatState, dst: FlatState, same_structure: bool = True) -> dict[str, Any]:
    """What the transport does: fill dst's tensors in place by name or alias; extras over the wire as JSON."""
    if same_structure:
        assert metadata(dst) == metadata(src)
    by_name = {name: e.tensor for e in src.tensors for name in (e.name, *e.aliases)}
    with torch.no_grad():
        for entry in dst.tensors:
            entry.tensor.copy_(by_name[entry.name])
    return json.loads(json.dumps(src.extras, allow_nan=False))


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sda, sdb = a.state_dict(), b.state_dict()
    assert sda["param_groups"] == sdb["param_groups"]
    assert list(sda["state"]) == list(sdb["state"])
    for pid, fields in sda["state"].items():
        assert_same_tensors(fields, sdb["state"][pid])


def next_randoms() -> tuple:
    return torch.rand(4), random.random(), np.random.rand(3)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_round_trip_into_a_fresh_state_is_bit_exact(scheduler: str) -> None:
    src = make_training(0, scheduler)
    for step in range(3):
        train_step(*src, step)
    src_extra = {"epoch": 3, "tokens": 2**40, "ratio": float("nan"), "loader": {"pos": (7, 8)}}
    src_ema = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # not contiguous
    src_state = {"model": src[0], "optimizer": src[1], "scheduler": src[2], "extra": src_extra, "ema": src_ema, "step": 3}
    random.seed(5)
    np.random.seed(6)
    saved = flatten_state(src_state, rank=0, rng=True)
    expected_randoms = next_randoms()

    dst = make_training(1, scheduler)
    dst_extra: dict[str, Any] = {"epoch": 0, "stale": True}
    dst_ema = torch.zeros(4, 3, dtype=torch.float64)
    dst_state = {"model": dst[0], "optimizer": dst[1], "scheduler": dst[2], "extra": dst_extra, "ema": dst_ema, "step": 0}
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    targets = flatten_state(dst_state, rank=0, rng=True)
    restore_state(dst_state, targets, transfer(saved, targets))

    assert_same_tensors(src[0].state_dict(), dst[0].state_dict())
    assert_same_optimizer(src[1], dst[1])
    assert src[2].state_dict() == dst[2].state_dict()
    assert dst_state["extra"] is dst_extra and dst_extra.keys() == src_extra.keys()
    assert json.dumps(dst_extra) == json.dumps(src_extra)  # NaN included
    assert dst_state["ema"] is dst_ema and torch.equal(dst_ema, src_ema)
    assert dst_state["step"] == 3
    randoms = next_randoms()
    assert torch.equal(randoms[0], expected_randoms[0])
    assert randoms[1] == expected_randoms[1]
    assert np.array_equal(randoms[2], expected_randoms[2])

    for run in (src, dst):
        with torch.random.fork_rng():
            torch.manual_seed(7)
            train_step(*run, 3)
    assert_same_tensors(src[0].state_dict(), dst[0].state_dict())
    assert_same_optimizer(src[1], dst[1])
    assert src[2].get_last_lr() == dst[2].get_last_lr()


def test_names_and_kinds_follow_the_top_level_keys() -> None:
    model, opt, sched = make_training(0)
    flat = flatten_state({"model": model, "optimizer": opt, "scheduler": sched, "master": {"w": torch.ones(2)}}, rank=3, rng=True)
    kinds = {e.name: e.kind for e in flat.tensors}
    assert kinds["model/embed.weight"] == "model"
    assert kinds["model/seen"] == "model"  # buffers are included
    assert kinds["optimizer/state/body.0.weight/exp_avg"] == "optimizer"
    assert kinds["optimizer/state/body.0.weight/step"] == "optimizer"
    assert kinds["master/w"] == "master"
    assert kinds["rng/rank3/torch_cpu"] == "extra"
    assert set(flat.extras) == {"optimizer", "scheduler", "master", "rng"}
    assert flat.extras["optimizer"]["param_groups"][0]["params"][0] == "embed.weight"
    assert flat.extras["scheduler"]["step_size"] == 2
    model_entries = [e.name for e in flat.tensors if e.kind == "model"]
    assert model_entries == [f"model/{k}" for k in model.state_dict()]


def test_entries_are_the_live_tensors() -> None:
    model, opt, _ = make_training(0)
    train_step(model, opt, SCHEDULERS["StepLR"](opt), 0)
    flat = flatten_state({"model": model, "optimizer": opt}, rank=0)
    by_name = {e.name: e.tensor for e in flat.tensors}
    assert by_name["model/embed.weight"].data_ptr() == model.embed.weight.data_ptr()
    assert by_name["optimizer/state/embed.weight/exp_avg"] is opt.state[model.embed.weight]["exp_avg"]


def test_tied_weights_are_one_entry_and_stay_tied() -> None:
    src = make_training(0, tied=True)
    train_step(*src, 0)
    src_state = {"model": src[0], "optimizer": src[1]}
    saved = flatten_state(src_state, rank=0)
    tied = [(e.name, e.aliases) for e in saved.tensors if e.aliases]
    assert tied == [
        ("model/embed.weight", ("model/head.weight",)),
        ("optimizer/state/embed.weight/step", ("optimizer/state/head.weight/step",)),
        ("optimizer/state/embed.weight/exp_avg", ("optimizer/state/head.weight/exp_avg",)),
        ("optimizer/state/embed.weight/exp_avg_sq", ("optimizer/state/head.weight/exp_avg_sq",)),
    ]
    assert "model/head.weight" not in {e.name for e in saved.tensors}

    dst = make_training(1, tied=True)
    dst_state = {"model": dst[0], "optimizer": dst[1]}
    targets = flatten_state(dst_state, rank=0)
    restore_state(dst_state, targets, transfer(saved, targets))
    assert dst[0].head.weight is dst[0].embed.weight
    assert torch.equal(dst[0].head.weight, src[0].embed.weight)
    assert_same_tensors(src[0].state_dict(), dst[0].state_dict())
    assert_same_optimizer(src[1], dst[1])


def test_a_tied_checkpoint_loads_into_an_untied_model_and_optimizer() -> None:
    src = make_training(0, tied=True)
    for step in range(2):
        train_step(*src, step)
    saved = flatten_state({"model": src[0], "optimizer": src[1]}, rank=0)

    dst = make_training(1, tied=False)
    dst_state = {"model": dst[0], "optimizer": dst[1]}
    targets = flatten_state(dst_state, rank=0)
    restore_state(dst_state, targets, transfer(saved, targets, same_structure=False))
    assert torch.equal(dst[0].head.weight, src[0].embed.weight)
    assert torch.equal(dst[0].embed.weight, src[0].embed.weight)
    tied_state = src[1].state[src[0].embed.weight]
    for param in (dst[0].embed.weight, dst[0].head.weight):
        assert_same_tensors(dst[1].state[param], tied_state)
    assert dst[1].param_groups[0]["lr"] == src[1].param_groups[0]["lr"]
    assert len(dst[1].param_groups[0]["params"]) == len(list(dst[0].parameters()))


def test_param_group_hyperparameters_come_from_the_checkpoint() -> None:
    src = make_training(0)
    for step in range(3):
        train_step(*src, step)  # StepLR halves the learning rate
    src[1].param_groups[0]["weight_decay"] = 0.25
    saved = flatten_state({"model": src[0], "optimizer": src[1]}, rank=0)
    dst = make_training(1)
    dst_state = {"model": dst[0], "optimizer": dst[1]}
    targets = flatten_state(dst_state, rank=0)
    restore_state(dst_state, targets, transfer(saved, targets))
    assert dst[1].param_groups[0]["lr"] == 5e-3 and dst[1].param_groups[0]["weight_decay"] == 0.25
    other = torch.optim.AdamW([{"params": dst[0].embed.parameters()}, {"params": dst[0].body.parameters()}])
    state = {"model": dst[0], "optimizer": other}
    with pytest.raises(ValueError, match="has 1 parameter groups, the one being loaded has 2"):
        restore_state(state, flatten_state(state, rank=0), transfer(saved, targets))


def test_views_of_one_storage_with_different_shapes_are_not_aliases() -> None:
    base = torch.arange(8.0)
    module = nn.Module()
    module.register_buffer("a", base[:4])
    module.register_buffer("b", base[4:])
    module.register_buffer("c", base.view(2, 4))
    module.register_buffer("empty1", torch.zeros(0))
    module.register_buffer("empty2", torch.zeros(0))
    flat = flatten_state({"model": module}, rank=0)
    assert [(e.name, e.aliases) for e in flat.tensors] == [
        ("model/a", ()), ("model/b", ()), ("model/c", ()), ("model/empty1", ()), ("model/empty2", ()),
    ]


class Counter(nn.Linear):
    """A module with extra state (non-parameter state that state_dict carries)."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.calls = 0
        self.history = torch.zeros(3)

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "history": self.history.clone()}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]
        self.history = state["history"].clone()


def test_module_extra_state_goes_through_load_state_dict() -> None:
    src = nn.Sequential(Counter())
    src[0].calls, src[0].history = 5, torch.tensor([1.0, 2.0, 3.0])
    saved = flatten_state({"model": src}, rank=0)
    assert "model/0._extra_state/history" in {e.name for e in saved.tensors}
    assert saved.extras["model"]["0._extra_state"]["calls"] == 5

    dst = nn.Sequential(Counter())
    targets = flatten_state({"model": dst}, rank=0)
    restore_state({"model": dst}, targets, transfer(saved, targets))
    assert dst[0].calls == 5 and torch.equal(dst[0].history, src[0].history)
    assert torch.equal(dst[0].weight, src[0].weight)


class Stateful:
    """A user object with state_dict()/load_state_dict() that holds a tensor."""

    def __init__(self, seed: int) -> None:
        self.position = seed
        self.weights = torch.full((2, 2), float(seed))

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        self.weights = state["weights"].clone()


def test_stateful_objects_round_trip_with_their_tensors() -> None:
    src, dst = Stateful(4), Stateful(0)
    saved = flatten_state({"loader": src}, rank=0)
    assert [(e.name, e.kind) for e in saved.tensors] == [("loader/weights", "extra")]
    targets = flatten_state({"loader": dst}, rank=0)
    restore_state({"loader": dst}, targets, transfer(saved, targets))
    assert dst.position == 4 and torch.equal(dst.weights, src.weights)


def test_lists_are_updated_in_place_and_read_only_states_refuse_immutables() -> None:
    live: list[Any] = [0]
    state = {"history": live, "name": "old"}
    saved = flatten_state({"history": [1, 2, (3,)], "name": "new"}, rank=0)
    targets = flatten_state(state, rank=0)
    restore_state(state, targets, transfer(saved, targets))
    assert state["history"] is live and live == [1, 2, (3,)]
    assert state["name"] == "new"
    frozen = types.MappingProxyType({"name": "old"})
    with pytest.raises(TypeError, match=r"state\['name'\] is a str, which cannot be changed in place"):
        restore_state(frozen, flatten_state(frozen, rank=0), {"name": "new"})


def test_missing_extras_raise_when_strict_and_are_left_alone_otherwise() -> None:
    state = {"extra": {"epoch": 1}}
    targets = flatten_state(state, rank=0, rng=True)
    with pytest.raises(ValueError, match="the checkpoint has no value for 'extra'"):
        restore_state(state, targets, {})
    restore_state(state, targets, {}, strict=False)
    assert state == {"extra": {"epoch": 1}}


def test_a_saved_tensor_without_a_place_in_the_loaded_state_is_named() -> None:
    saved = flatten_state({"extra": {"ema": torch.ones(2)}}, rank=0)
    state: dict[str, Any] = {"extra": {}}
    targets = flatten_state(state, rank=0)
    with pytest.raises(ValueError, match=r"tensor 'extra/ema' that the state being loaded has no place for"):
        restore_state(state, targets, json.loads(json.dumps(saved.extras)))


def test_fingerprint_is_stable_and_follows_the_metadata() -> None:
    a = flatten_state({"model": Net()}, rank=0)
    assert a.fingerprint() == flatten_state({"model": Net()}, rank=0).fingerprint()
    assert a.fingerprint() != flatten_state({"model": Net(vocab=51)}, rank=0).fingerprint()
    assert a.fingerprint() != flatten_state({"model": Net(tied=True)}, rank=0).fingerprint()
    assert a.fingerprint() != flatten_state({"model": Net().double()}, rank=0).fingerprint()
    entry = TensorEntry("extra/x", "extra", torch.zeros(2, 3))
    code = (
        "import torch; from ckptd.client.state import FlatState, TensorEntry; "
        "print(FlatState((TensorEntry('extra/x', 'extra', torch.zeros(2, 3)),), {}).fingerprint())"
    )
    other_process = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert other_process == FlatState((entry,), {}).fingerprint()


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(2, 2)


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([("model", 1)], TypeError, "state must be a mapping"),
        ({}, ValueError, "state is empty"),
        ({1: torch.ones(1)}, TypeError, "state key 1 is a int"),
        ({"a/b": 1}, ValueError, "without '/'"),
        ({"": 1}, ValueError, "non-empty string"),
        ({"extra": {"when": object()}}, TypeError, r"'extra/when'.*state_dict\(\)/load_state_dict\(\)"),
        ({"extra": {"s": torch.eye(3).to_sparse()}}, TypeError, r"'extra/s'.*torch.sparse_coo.*to_dense"),
        ({"model": {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}}, TypeError, r"'model/n'.*nested tensor.*unbind\(\)"),
        ({"model": meta_model()}, ValueError, r"'model/weight'.*meta device"),
        ({"extra": torch.zeros(2, dtype=torch.complex64)}, TypeError, r"'extra'.*complex64 cannot be checkpointed"),
        # a lazily negated view's memory holds the negatives: stored as memory, it loaded back with the sign flipped
        ({"model": {"t": torch._neg_view(torch.arange(1.0, 5.0))}}, ValueError, r"'model/t'.*negated view.*resolve_neg\(\)"),
        ({"model": {"t": torch.tensor([1 + 2j]).conj().imag}}, ValueError, r"'model/t'.*negated view"),
        ({"extra": {"a/b": torch.ones(1), "a": {"b": torch.ones(1)}}}, ValueError, "both named 'extra/a/b'"),
        ({"optimizer": torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)}, ValueError, "put its model in the same state under 'model'"),
    ],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_bad_states_are_refused_with_the_key_named(state: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        flatten_state(state, rank=0)


def test_rng_refuses_a_user_key_named_rng() -> None:
    with pytest.raises(ValueError, match="rename the key"):
        flatten_state({"rng": 1}, rank=0, rng=True)
    assert flatten_state({"rng": 1}, rank=0).extras == {"rng": 1}


def test_optimizer_parameters_outside_the_model_are_refused() -> None:
    model = nn.Linear(2, 2)
    stray = nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([*model.parameters(), stray])
    with pytest.raises(ValueError, match=r"must belong to state\['model'\]"):
        flatten_state({"model": model, "optimizer": opt}, rank=0)


def test_frozen_parameters_and_buffers_are_marked_and_a_tied_trained_tensor_is_not() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    model[2].weight.requires_grad_(False)
    flat = flatten_state({"model": model, "extra": {"t": torch.zeros(2)}}, rank=0)
    frozen = {e.name: e.frozen for e in flat.tensors}
    assert frozen["model/0.weight"] == frozen["model/0.bias"] == frozen["model/2.weight"] == "param"
    assert frozen["model/2.bias"] == ""
    assert frozen["model/1.running_mean"] == frozen["model/1.num_batches_tracked"] == "buffer"
    assert frozen["model/1.weight"] == "" and frozen["extra/t"] == ""
    wrapped = {e.name: e.frozen for e in flatten_state({"model": torch.compile(model)}, rank=0).tensors}
    assert wrapped == {n: f for n, f in frozen.items() if n.startswith("model/")}  # a wrapper's prefixed names, marked alike
    before = flat.fingerprint()
    model[2].bias.requires_grad_(False)  # freezing changes the structure the daemon plans for
    assert flatten_state({"model": model, "extra": {"t": torch.zeros(2)}}, rank=0).fingerprint() != before

    tied = nn.Module()
    tied.a = nn.Linear(3, 3, bias=False)
    tied.b = nn.Linear(3, 3, bias=False)
    tied.b.weight = tied.a.weight
    tied.frozen_copy = nn.Linear(3, 3, bias=False).requires_grad_(False)
    entries = {e.name: e for e in flatten_state({"model": tied}, rank=0).tensors}
    assert entries["model/a.weight"].frozen == "" and entries["model/a.weight"].aliases == ("model/b.weight",)
    assert entries["model/frozen_copy.weight"].frozen == "param"


def test_a_negated_view_is_refused_also_by_the_structures_fast_checks() -> None:
    """Found by an attacker's probe: the plain-state fast path (a new client's first build, every
    save's) must refuse what the general check refuses: the negated view round-tripped as -x."""
    from ckptd.client.structure import StructureCache

    state = {"model": {"w": torch.ones(3), "t": torch._neg_view(torch.arange(1.0, 5.0))}}
    flat = flatten_state(state, rank=0, validate=False)
    with pytest.raises(ValueError, match=r"'model/t'.*negated view"):
        StructureCache().for_state(flat, None, None)


def test_a_negated_view_or_zero_tensor_put_where_a_tensor_was_is_refused_by_the_cached_structure() -> None:
    """Found in review: the checks ran only when a structure was built, and a negated view of a
    tensor has its address, dtype, shape and strides: the cached structure took it in (and the
    rebind, at another address). The signature says whether a tensor's memory holds its values."""
    from ckptd.client.structure import StructureCache

    cache = StructureCache()
    t = torch.arange(1.0, 5.0)
    cache.for_state(flatten_state({"model": {"t": t}}, rank=0, validate=False), None, None)
    for swapped in (torch._neg_view(t), torch._neg_view(torch.arange(2.0, 6.0)), torch._efficientzerotensor(4)):
        with pytest.raises(ValueError, match=r"'model/t'.*(negated view|efficient zero)"):
            cache.for_state(flatten_state({"model": {"t": swapped}}, rank=0, validate=False), None, None)
    with pytest.raises(ValueError, match=r"'extra/z'.*efficient zero"):
        flatten_state({"extra": {"z": torch._efficientzerotensor(3)}}, rank=0)


def test_a_tensor_made_a_negated_view_through_data_is_refused_by_the_cached_structure() -> None:
    """`t.data = torch._neg_view(u)` makes the very same tensor object (the same entries of an
    unchanged state walk) a negated view: the signature reads the flag every time."""
    from ckptd.client.structure import StructureCache
    from ckptd.client.walk import StateWalk

    walk, cache = StateWalk(), StructureCache()
    t = torch.arange(1.0, 5.0)
    state = {"model": {"t": t}}
    cache.for_state(walk.flatten(state, rank=0), None, None)
    t.data = torch._neg_view(torch.arange(2.0, 6.0))
    with pytest.raises(ValueError, match=r"'model/t'.*negated view"):
        cache.for_state(walk.flatten(state, rank=0), None, None)


def test_rng_must_be_a_bool() -> None:
    """Found by a probe: rng="yes" was taken as True."""
    with pytest.raises(TypeError, match=r"rng='yes': pass True"):
        flatten_state({"model": torch.nn.Linear(2, 2)}, rank=0, rng="yes")  # type: ignore[arg-type]
