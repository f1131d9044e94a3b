"""The requests the engine takes whole (engine/requests.py), as rpc/validate.py builds them from
their messages: every field where the engine expects it, defaults for what an older client
leaves out, and InvalidRequest for what it must not send."""

from __future__ import annotations

import pytest

from ckptd.common.boxes import Box
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

