"""IdentityMemo: a value derived from some objects, kept while they are the very same objects."""

from __future__ import annotations

from ckptd.daemon.memo import IdentityMemo


def test_a_value_is_made_once_for_the_same_objects_and_again_for_equal_others() -> None:
    memo: IdentityMemo[int] = IdentityMemo(size=2)
    made: list[int] = []

    def make(n: int) -> int:
        made.append(n)
        return n

    a, b = [1], [2]
    assert memo.get((a, b), lambda: make(1)) == 1
    assert memo.get((a, b), lambda: make(9)) == 1  # the same objects: kept
    assert memo.get(([1], b), lambda: make(2)) == 2  # an equal list, another object: made
    assert made == [1, 2]


def test_the_oldest_value_goes_beyond_the_size() -> None:
    memo: IdentityMemo[str] = IdentityMemo(size=2)
    first, second, third = object(), object(), object()
    memo.get((first,), lambda: "first")
    memo.get((second,), lambda: "second")
    memo.get((third,), lambda: "third")
    assert memo.get((first,), lambda: "again") == "again"
    assert memo.get((third,), lambda: "not made") == "third"


def test_an_object_that_takes_a_weak_reference_is_not_kept_alive_and_one_that_does_not_is() -> None:
    import gc
    import weakref

    class Index:  # like a CheckpointIndex or a SavePlan: its own cache decides how long it lives
        pass

    memo: IdentityMemo[int] = IdentityMemo(size=4)
    index, specs = Index(), (1, 2)
    assert memo.get((index, specs), lambda: 1) == 1
    gone = weakref.ref(index)
    del index
    gc.collect()
    assert gone() is None
    assert memo.get((Index(), specs), lambda: 2) == 2  # whatever id the new object got: made anew
