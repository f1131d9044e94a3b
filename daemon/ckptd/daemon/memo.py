"""A small cache of what was derived from some objects, kept while they are the very same ones.

The daemon derives things from objects it keeps while they hold: a save plan, a rank's
resolved specs, a step's index, a held plan's pieces. A value made from them is good as long as
they are the same objects; `IdentityMemo` keys it by their identities and holds the objects
with it, so an id is never reused for another object while its entry lives.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

V = TypeVar("V")


class IdentityMemo(Generic[V]):
    """The last `size` values `make()` gave for a tuple of objects, compared by identity."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._known: dict[tuple[int, ...], tuple[tuple[Any, ...], V]] = {}

    def get(self, objects: tuple[Any, ...], make: Callable[[], V]) -> V:
        """The value kept for these very objects, else `make()`'s (kept; the oldest entry goes
        beyond `size`)."""
        key = tuple(map(id, objects))
        found = self._known.get(key)
        if found is None or any(a is not b for a, b in zip(found[0], objects)):
            found = self._known[key] = (objects, make())
            while len(self._known) > self._size:
                del self._known[next(iter(self._known))]
        return found[1]
