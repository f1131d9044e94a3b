"""The service's in-process parts (its RPC behaviour is tested through real daemons in tests/integration)."""

from __future__ import annotations

from ckptd.daemon.service import IndexCache


def test_the_daemon_keeps_a_bounded_number_of_parsed_indexes_most_recently_used_last() -> None:
    cache = IndexCache(2)
    cache.put(("j", 1), "one")  # type: ignore[arg-type]
    cache.put(("j", 2), "two")  # type: ignore[arg-type]
    assert cache.get(("j", 1)) == "one"  # now the most recent
    cache.put(("j", 3), "three")  # type: ignore[arg-type]
    assert cache.get(("j", 2)) is None and cache.get(("j", 1)) == "one" and cache.get(("j", 3)) == "three"
    assert cache.pop(("j", 3)) == "three" and cache.get(("j", 3)) is None
