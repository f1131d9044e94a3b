"""Retention as tables: which of 30 committed steps each policy deletes."""

import itertools

import pytest

from ckptd.daemon.plan.retention import RetentionPolicy

STEPS = list(range(10, 310, 10))  # 30 committed steps: 10, 20, ..., 300
ALL = set(STEPS)


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "protected", "kept"),
    [
        (3, 0, (), {280, 290, 300}),
        (1, 0, (), {300}),
        (0, 0, (), ALL),  # 0 = keep all
        (0, 100, (), ALL),
        (30, 0, (), ALL),
        (100, 0, (), ALL),
        (3, 100, (), {100, 200, 280, 290, 300}),
        (3, 50, (), {50, 100, 150, 200, 250, 280, 290, 300}),
        (2, 70, (), {70, 140, 210, 280, 290, 300}),  # 280 is kept by both rules
        (1, 1, (), ALL),
        (1, 7, (), {70, 140, 210, 280, 300}),
        (1, 1000, (), {300}),  # no step divisible: only the newest
        (1, 0, (10, 150), {10, 150, 300}),  # protected (being loaded) survive
        (2, 100, (20,), {20, 100, 200, 290, 300}),
        (3, 0, (290, 999), {280, 290, 300}),  # protected but not committed: ignored
    ],
)
def test_kept_steps(keep_last: int, keep_every: int, protected: tuple[int, ...], kept: set[int]) -> None:
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
    deleted = policy.to_delete(STEPS, protected)
    assert deleted == sorted(ALL - kept)


def test_defaults_keep_the_last_three() -> None:
    assert RetentionPolicy().to_delete(STEPS) == STEPS[:-3]


@pytest.mark.parametrize("steps", [[], [5], [0]])
def test_nothing_to_delete_in_tiny_jobs(steps: list[int]) -> None:
    assert RetentionPolicy(keep_last=1).to_delete(steps) == []


# ------------------------------------------------------------------ commit order (rollback)

# The input is the commit order, oldest first; "newest" is the last committed, not the highest
# step (docs/architecture.md §9). 10, 20, 30, then a rollback to 10 and a save of 15: 15 is the newest.
ROLLBACK = [10, 20, 30, 15]


@pytest.mark.parametrize(
    ("order", "keep_last", "keep_every", "protected", "deleted"),
    [
        (ROLLBACK, 2, 10, (), []),  # issue 20: 15 (the newest) and 30 by keep_last; 10, 20, 30 by keep_every
        (ROLLBACK, 1, 10, (), []),  # 15 is the newest: kept whatever keep_last says
        (ROLLBACK, 1, 0, (), [10, 20, 30]),
        (ROLLBACK, 2, 0, (), [10, 20]),  # the last two committed are 30 and 15, not 20 and 30
        (ROLLBACK, 3, 0, (), [10]),
        (ROLLBACK, 1, 0, (20,), [10, 30]),  # protected (being loaded) survive
        (ROLLBACK, 0, 0, (), []),  # keep_last=0 keeps all
        (ROLLBACK + [16, 17], 2, 10, (), [15]),  # the new timeline moves on: 15 ages out, 30 stays by keep_every
        (ROLLBACK + [16, 17], 2, 20, (), [10, 15, 30]),
        (ROLLBACK + [16, 17], 4, 0, (), [10, 20]),
        ([100, 200, 300, 1, 2], 2, 0, (), [100, 200, 300]),  # a job id reused: the old run's higher steps are older
        ([100, 200, 300, 1], 2, 0, (), [100, 200]),
        ([100, 200, 300, 1], 2, 100, (), []),
        ([30, 20, 10], 1, 0, (), [20, 30]),  # counting down: 10 is the newest
        ([0, 55, 5], 1, 10, (), [55]),  # step 0 is divisible by any keep_every
        (STEPS, 3, 100, (), sorted(ALL - {100, 200, 280, 290, 300})),  # ascending commits: as by step number
    ],
)
def test_kept_steps_follow_the_commit_order(
    order: list[int], keep_last: int, keep_every: int, protected: tuple[int, ...], deleted: list[int]
) -> None:
    assert RetentionPolicy(keep_last=keep_last, keep_every=keep_every).to_delete(order, protected) == deleted


def test_the_same_steps_in_another_commit_order_keep_other_steps() -> None:
    policy = RetentionPolicy(keep_last=2)
    assert policy.to_delete([10, 15, 20, 30]) == [10, 15]
    assert policy.to_delete([10, 20, 30, 15]) == [10, 20]
    assert policy.to_delete([15, 30, 20, 10]) == [15, 30]


def test_a_step_just_committed_after_a_rollback_is_never_deleted_by_its_commit() -> None:
    """Commit one step at a time and delete what the policy says, as the daemon does after each
    commit: whatever the timeline, the step just committed survives, and the rolled-back timeline
    keeps its last `keep_last` steps."""
    policy = RetentionPolicy(keep_last=2, keep_every=10)
    present: list[int] = []  # commit order
    for step in [10, 20, 30, 15, 16, 17, 18, 25, 12, 13]:
        present.append(step)
        gone = policy.to_delete(present)
        assert step not in gone, f"step {step} deleted by its own commit"
        present = [s for s in present if s not in gone]
    assert present == [10, 20, 30, 12, 13]


@pytest.mark.parametrize("seed", range(20))
def test_invariants_in_any_commit_order(seed: int) -> None:
    import random

    order = random.Random(seed).sample(STEPS, len(STEPS))
    for keep_last, keep_every in itertools.product([1, 2, 5], [0, 40]):
        deleted = RetentionPolicy(keep_last, keep_every).to_delete(order, (order[0],))
        assert deleted == sorted(deleted)
        assert order[-1] not in deleted  # never the newest (the last committed)
        assert order[0] not in deleted  # never a protected step
        assert not set(order[-keep_last:]) & set(deleted)  # the keep_last most recently committed
        assert set(deleted) == set(order[:-keep_last]) - {order[0]} - {s for s in order if keep_every and s % keep_every == 0}


def test_a_step_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[30\] are listed more than once"):
        RetentionPolicy(keep_last=4).to_delete([10, 20, 30, 15, 30])


def test_keep_best_ties_and_reasons_follow_the_commit_order() -> None:
    policy = RetentionPolicy(keep_last=1, keep_best=1)
    assert policy.best([10, 20, 30, 15], {30: 0.5, 15: 0.5}) == [15]  # tie: the more recently committed
    assert policy.best([10, 20, 15, 30], {30: 0.5, 15: 0.5}) == [30]
    assert policy.reasons(15, ROLLBACK) == ["newest", "last 1"]
    assert policy.reasons(30, ROLLBACK) == []


@pytest.mark.parametrize(
    ("keep_last", "keep_every"), list(itertools.product([0, 1, 2, 5, 29, 31], [0, 1, 3, 40, 300]))
)
@pytest.mark.parametrize("protected", [(), (10,), (150, 300), (300,)])
def test_invariants(keep_last: int, keep_every: int, protected: tuple[int, ...]) -> None:
    deleted = RetentionPolicy(keep_last, keep_every).to_delete(STEPS, protected)
    assert deleted == sorted(deleted)
    assert set(deleted) <= ALL
    assert max(STEPS) not in deleted  # never the newest
    assert not set(deleted) & set(protected)  # never a step being read
    if keep_last == 0:
        assert deleted == []
    else:
        assert len(ALL - set(deleted)) >= min(keep_last, len(STEPS))
        assert not set(STEPS[-keep_last:]) & set(deleted)
    if keep_every:
        assert all(step % keep_every for step in deleted)


@pytest.mark.parametrize(("keep_last", "keep_every"), [(-1, 0), (0, -5), (1.5, 0), (True, 0), (3, "10")])
def test_bad_policies_are_refused(keep_last: object, keep_every: object) -> None:
    with pytest.raises(ValueError, match="expected an integer >= 0"):
        RetentionPolicy(keep_last=keep_last, keep_every=keep_every)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2.5, "7", None])
def test_bad_steps_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="committed step"):
        RetentionPolicy().to_delete([1, 2, bad])  # type: ignore[list-item]


# ------------------------------------------------------------------ keep best by metric

# A loss per step: step 10 has 3.0, step 20 has 2.9, ... falling, with two dips.
LOSS = {s: 3.0 - 0.01 * (s // 10) for s in STEPS}
LOSS[50] = 0.5  # best
LOSS[120] = 0.7  # second best
LOSS[130] = 0.7  # tie with 120: the newer step wins


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "keep_best", "mode", "metrics", "kept"),
    [
        (1, 0, 1, "min", LOSS, {50, 300}),
        (1, 0, 2, "min", LOSS, {50, 130, 300}),
        (1, 0, 3, "min", LOSS, {50, 120, 130, 300}),
        (2, 100, 1, "min", LOSS, {50, 100, 200, 290, 300}),
        (1, 0, 1, "max", LOSS, {10, 300}),  # higher is better: the first step has the highest loss
        (1, 0, 2, "max", {10: 0.1, 20: 0.9, 30: float("nan")}, {20, 10, 300}),  # NaN never counts
        (1, 0, 2, "min", {}, {300}),  # no step has a metric
        (1, 0, 2, "min", {20: 5.0, 999: 0.0}, {20, 300}),  # metrics of steps that are not committed are ignored
        (0, 0, 1, "min", LOSS, ALL),  # keep_last=0 keeps all, whatever the other rules
        (3, 0, 0, "min", LOSS, {280, 290, 300}),  # keep_best=0: the rule is off
        (1, 0, 30, "min", LOSS, ALL),
    ],
)
def test_keep_best(keep_last: int, keep_every: int, keep_best: int, mode: str, metrics: dict[int, float], kept: set[int]) -> None:
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, best_mode=mode)
    assert policy.to_delete(STEPS, (), metrics) == sorted(ALL - kept)


def test_best_steps_survive_while_newer_worse_ones_come_and_go() -> None:
    policy = RetentionPolicy(keep_last=2, keep_best=1)
    present: list[int] = []
    for step in STEPS:  # commit one at a time, deleting what the policy says, as the daemon does
        present.append(step)
        for gone in policy.to_delete(present, (), LOSS):
            present.remove(gone)
    assert present == [50, 290, 300]


def test_reasons_say_why_a_step_is_kept() -> None:
    policy = RetentionPolicy(keep_last=2, keep_every=100, keep_best=1)
    assert policy.reasons(300, STEPS, (), LOSS) == ["newest", "last 2", "every 100"]
    assert policy.reasons(50, STEPS, (50,), LOSS) == ["being loaded", "best 1 (min)"]
    assert policy.reasons(60, STEPS, (), LOSS) == []
    assert policy.reasons(999, STEPS, (), LOSS) == []


@pytest.mark.parametrize(("field", "value"), [("keep_best", -1), ("keep_best", 1.0), ("best_mode", "lower"), ("best_mode", "")])
def test_bad_best_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**{field: value})  # type: ignore[arg-type]


# ---------------------------------------------------------------- a job's own retention (issue 31 item 7)

from ckptd.daemon.plan.retention import JobRetention, merge, policy_of_record, policy_record  # noqa: E402


# issue 31 item 7
@pytest.mark.parametrize(
    ("daemon", "job", "merged"),
    [
        (RetentionPolicy(3), None, RetentionPolicy(3)),  # nothing asked: the daemon's flags
        (RetentionPolicy(3), JobRetention(), RetentionPolicy(3)),
        (RetentionPolicy(3), JobRetention(keep_last=2), RetentionPolicy(2)),  # fewer: granted
        (RetentionPolicy(3), JobRetention(keep_last=10), RetentionPolicy(3)),  # more: bounded by the daemon's
        (RetentionPolicy(3), JobRetention(keep_last=0), RetentionPolicy(3)),  # keep all: the daemon's bound
        (RetentionPolicy(0), JobRetention(keep_last=10), RetentionPolicy(10)),  # a daemon that keeps all bounds nothing
        (RetentionPolicy(0), JobRetention(keep_last=0), RetentionPolicy(0)),
        (RetentionPolicy(3, keep_every=100), JobRetention(keep_last=1), RetentionPolicy(1, keep_every=100)),  # keep_every: the daemon's
        (RetentionPolicy(3), JobRetention(keep_best=1, best_mode="max"), RetentionPolicy(3, keep_best=1, best_mode="max")),
        (RetentionPolicy(3), JobRetention(keep_last=2, keep_best=5), RetentionPolicy(2, keep_best=2)),  # best: at most keep_last
        (RetentionPolicy(0), JobRetention(keep_best=5), RetentionPolicy(0, keep_best=5)),
        (RetentionPolicy(3, keep_best=2, best_mode="max"), JobRetention(keep_last=2), RetentionPolicy(2, keep_best=2, best_mode="max")),
        (RetentionPolicy(3, keep_best=2, best_mode="max"), JobRetention(keep_best=0), RetentionPolicy(3, keep_best=0, best_mode="max")),
        (RetentionPolicy(3, keep_best=1, best_mode="min"), JobRetention(best_mode="max"), RetentionPolicy(3, keep_best=1, best_mode="max")),
    ],
)
def test_a_jobs_retention_merges_within_the_daemons(daemon: RetentionPolicy, job: JobRetention | None, merged: RetentionPolicy) -> None:
    assert merge(daemon, job) == merged
    if job is not None:
        assert policy_of_record(policy_record(merged, job)) == merged


# issue 31 item 7
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"keep_last": -1}, "keep_last=-1"),
        ({"keep_best": True}, "keep_best=True"),
        ({"keep_last": 1 << 31}, "keep_last=2147483648"),
        ({"best_mode": "lowest"}, "best_mode='lowest'"),
    ],
)
def test_a_bad_job_retention_is_refused(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        JobRetention(**kwargs)
