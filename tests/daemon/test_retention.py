"""Retention as tables: which of 30 committed steps each policy deletes."""

import itertools

import pytest

from ckptd.daemon.retention import RetentionPolicy

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


def test_order_and_duplicates_of_the_input_do_not_matter() -> None:
    shuffled = STEPS[15:] + STEPS[:15] + STEPS[:5]
    assert RetentionPolicy(keep_last=4).to_delete(shuffled) == STEPS[:-4]


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
