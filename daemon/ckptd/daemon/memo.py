"""A small cache of what was derived from some objects, kept while they are the very same ones.

The daemon derives things from objects it keeps while they hold: a save plan, a rank's
resolved specs, a step's index, a held plan's pieces. A value made from them is good as long as
they are the same objects; `IdentityMemo` keys it by their identities. It holds each object
weakly when the object allows it (a plan, an index: the caches that own them decide how long
they live, not this memo), else with the entry (a tuple of specs); either way an entry is used
only while every object it was made of is still that very object.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, TypeVar

V = TypeVar("V")


class IdentityMemo(Generic[V]):
    """The last `size` values `make()` gave for a tuple of objects, compared by identity."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._known: dict[tuple[int, ...], tuple[tuple[Callable[[], Any], ...], V]] = {}

    def get(self, objects: tuple[Any, ...], make: Callable[[], V]) -> V:
        """The value kept for these very objects, else `make()`'s (kept; the oldest entry goes
        beyond `size`)."""
        key = tuple(map(id, objects))
        found = self._known.get(key)
        if found is None or any(held() is not o for held, o in zip(found[0], objects)):
            self._known.pop(key, None)  # made of objects gone since (an id reused): new, so last
            found = self._known[key] = (tuple(map(_holder, objects)), make())
            while len(self._known) > self._size:
                del self._known[next(iter(self._known))]
        return found[1]


def _holder(obj: Any) -> Callable[[], Any]:
    """A weak reference to `obj`, or (for what takes none: tuples, lists) a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
