"""One read for many askers (engine/single_flight.py): the ranks of a restarted daemon plan their
loads together, and each would otherwise fetch and parse the same index and extras."""

from __future__ import annotations

import asyncio

import pytest

from ckptd.daemon.engine.single_flight import SingleFlight


def test_callers_that_ask_while_a_read_runs_share_it_and_the_next_caller_reads_again() -> None:
    async def main() -> None:
        flight: SingleFlight[str, int] = SingleFlight()
        reads: list[int] = []
        kept: list[int] = []
        release = asyncio.Event()

        async def read() -> int:
            reads.append(1)
            await release.wait()
            return len(reads)

        callers = [asyncio.ensure_future(flight.run("k", read, kept.append)) for _ in range(5)]
        await asyncio.sleep(0)
        release.set()
        assert await asyncio.gather(*callers) == [1] * 5
        assert reads == [1] and kept == [1]  # kept once, not once per caller
        assert await flight.run("k", read) == 2  # nothing remembered after it ended
        assert await flight.run("other", read) == 3

    asyncio.run(main())


def test_every_caller_gets_the_reads_error_and_nothing_is_kept() -> None:
    async def main() -> None:
        flight: SingleFlight[str, int] = SingleFlight()
        kept: list[int] = []
        release = asyncio.Event()

        async def read() -> int:
            await release.wait()
            raise OSError("index unreadable")

        callers = [asyncio.ensure_future(flight.run("k", read, kept.append)) for _ in range(3)]
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(*callers, return_exceptions=True)
        assert all(isinstance(r, OSError) and "unreadable" in str(r) for r in results) and kept == []

        async def works() -> int:
            return 7

        assert await flight.run("k", works) == 7  # a failed read is not remembered

    asyncio.run(main())


def test_a_caller_cancelled_does_not_cancel_the_read_for_the_others() -> None:
    async def main() -> None:
        flight: SingleFlight[str, int] = SingleFlight()
        release = asyncio.Event()

        async def read() -> int:
            await release.wait()
            return 42

        first = asyncio.ensure_future(flight.run("k", read))
        second = asyncio.ensure_future(flight.run("k", read))
        await asyncio.sleep(0)
        first.cancel()  # its client went away
        await asyncio.sleep(0)
        release.set()
        assert await second == 42
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())
