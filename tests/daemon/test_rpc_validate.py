"""The requests the engine takes whole (engine/requests.py), as rpc/validate.py builds them from
their messages: every field where the engine expects it, defaults for what an older client
leaves out, and InvalidRequest for what it must not send."""

from __future__ import annotations

import pytest

from ckptd.common.boxes import Box
from ckptd.common.names import InvalidNameError
from ckptd.daemon.engine.requests import BeginSave, PlanLoad
from ckptd.daemon.errors import InvalidRequest
from ckptd.daemon.plan.compression import SaveOptions
from ckptd.daemon.plan.retention import JobRetention
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.rpc import validate
from ckptd.wire.v1 import checkpoint_pb2 as pb

WHO = pb.RankId(job="job", rank=1, world_size=2)
META = pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4])
SPEC = TensorSpec("model/w", "model", "F32", (4,), Box.full((4,)))
CLIENT = "abcdefgh1234"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (pb.BeginSaveRequest(who=WHO, step=3, fingerprint="fp"), BeginSave("job", 1, 2, 3, "fp", None, None)),
        (
            pb.BeginSaveRequest(
                who=pb.RankId(job="job", rank=1, world_size=2, local_world_size=1, run_id="run1", client_id=CLIENT), step=3,
                fingerprint="fp", tensors=[META], metric=0.5, has_metric=True, timeout_s=9.0, quantize="O2", master_weights="drop",
                lineage_generation=2, resumed=True, resumed_from=1, retention=pb.Retention(keep_last=3),
            ),
            BeginSave(
                "job", 1, 2, 3, "fp", [SPEC], 0.5, 9.0, 1, SaveOptions("O2", "drop", False, JobRetention(keep_last=3)), 2, "run1", 1, CLIENT
            ),
        ),
        (pb.BeginSaveRequest(who=WHO, step=3, fingerprint="fp", no_quantize=True), BeginSave("job", 1, 2, 3, "fp", None, None, options=SaveOptions(no_quantize=True))),
    ],
)
def test_a_begin_save_carries_every_field(message: pb.BeginSaveRequest, expected: BeginSave) -> None:
    assert validate.begin_save_of(message) == expected


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (pb.BeginSaveRequest(who=WHO, step=-1, fingerprint="fp"), "step -1"),
        (pb.BeginSaveRequest(who=WHO, step=1), "fingerprint"),
        (pb.BeginSaveRequest(who=WHO, step=1, fingerprint="fp", quantize="O2", no_quantize=True), "contradict"),
        (pb.BeginSaveRequest(who=pb.RankId(job="job", rank=2, world_size=2), step=1, fingerprint="fp"), "rank 2"),
    ],
)
def test_a_bad_begin_save_is_refused(message: pb.BeginSaveRequest, error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        validate.begin_save_of(message)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            pb.PlanLoadRequest(who=WHO, latest=True, kinds=["model"], strict=True, direct_read=True, decodes=True, decodes_frames=True),
            PlanLoad("job", 1, 2, None, [SPEC], ["model"], True),
        ),
        (  # a client older than direct reads and decoding leaves them unset
            pb.PlanLoadRequest(who=pb.RankId(job="job", rank=1, world_size=2, run_id="run1"), step=7),
            PlanLoad("job", 1, 2, 7, [SPEC], [], False, direct_read=False, decodes=False, decodes_frames=False, run="run1"),
        ),
    ],
)
def test_a_plan_load_carries_every_field_and_the_wanted_specs_object(message: pb.PlanLoadRequest, expected: PlanLoad) -> None:
    wanted = [SPEC]
    load = validate.plan_load_of(message, lambda job, rank: wanted)
    assert load == expected and load.wanted is wanted  # the very object: a memory-tier plan is reused by identity



def _specs_one_by_one(metas: list[pb.TensorMeta]) -> list[TensorSpec]:
    return [validate._tensor_spec(m) for m in metas]


MANY = [  # a rank's usual metadata: thousands of tensors of a few shapes, some boxed, aliased or frozen
    pb.TensorMeta(name=f"model/layer{i}/w", kind="model", dtype="BF16", shape=[64, 32], box=pb.Box(offsets=[32 * (i % 2), 0], lengths=[32, 32]))
    for i in range(40)
] + [
    pb.TensorMeta(name="model/emb", kind="model", dtype="F32", shape=[10, 4], aliases=["model/head"]),
    pb.TensorMeta(name="model/frozen", kind="model", dtype="F16", shape=[3], frozen="param"),
    pb.TensorMeta(name="optimizer/state/0/exp_avg", kind="optimizer", dtype="F32", shape=[64, 32]),
    pb.TensorMeta(name="optimizer/state/0/step", kind="optimizer", dtype="F32", shape=[]),
    pb.TensorMeta(name="extra/rank1/rng", kind="extra", dtype="U8", shape=[16], per_rank=True),
    pb.TensorMeta(name="extra/empty", kind="extra", dtype="I64", shape=[0, 5]),
]


@pytest.mark.parametrize("metas", [MANY, MANY[:40], MANY[40:], []])
def test_specs_checked_by_columns_equal_those_checked_one_by_one(metas: list[pb.TensorMeta]) -> None:
    assert validate.tensor_specs(metas) == _specs_one_by_one(metas)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (pb.TensorMeta(name="", kind="model", dtype="F32", shape=[4]), "non-empty"),
        (pb.TensorMeta(name="model/\x01w", kind="model", dtype="F32", shape=[4]), "control characters"),
        (pb.TensorMeta(name="model/w", kind="weights", dtype="F32", shape=[4]), "kind 'weights'"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="float32", shape=[4]), "dtype 'float32'"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[-1]), "negative, huge"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[1 << 30, 1 << 30]), "larger than"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[0, 0], lengths=[4])), "2 offsets and 1 lengths"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[2], lengths=[4])), "does not lie inside"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], aliases=["__metadata__"]), "reserves"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], frozen="yes"), "frozen 'yes'"),
        (pb.TensorMeta(name="optimizer/w", kind="optimizer", dtype="F32", shape=[4], frozen="param"), "only model tensors"),
        (pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], per_rank=True), "per_rank"),
    ],
)
def test_a_bad_tensor_among_many_is_named_whichever_way_it_is_checked(bad: pb.TensorMeta, error: str) -> None:
    """The columns fall back to the one-by-one checks, whose message names the tensor (a bad name
    is an InvalidNameError, mapped to INVALID_ARGUMENT as InvalidRequest is: rpc/errors.py)."""
    with pytest.raises((InvalidRequest, InvalidNameError), match=error):
        validate.tensor_specs([*MANY, bad])
    with pytest.raises((InvalidRequest, InvalidNameError), match=error):
        _specs_one_by_one([bad])


def test_specs_of_one_shape_share_their_box() -> None:
    """A distinct (dtype, shape, box) is checked once, and its Box made once."""
    specs = validate.tensor_specs(MANY[:40])
    assert len({id(s.box) for s in specs}) == 2
