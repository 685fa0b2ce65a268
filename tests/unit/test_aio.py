"""cancel_and_wait: a broker task whose loop swallowed a cancellation still ends (the stop path)."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.broker.aio import cancel_and_wait


def test_a_loop_that_swallowed_the_cancel_still_ends() -> None:
    """The etcd lease keeper's shape: a loop over ``wait_for(event.wait(), ...)``. On Python 3.11
    ``wait_for`` swallows a cancel that lands as the event is set (gh-86296; a plain cancel-then-await
    waited forever, and the broker never exited on SIGTERM). The keeper here swallows the first
    cancel itself, as that ``wait_for`` did, so the case is the same on every Python version: a
    plain ``task.cancel(); await task`` never returns, and cancel_and_wait cancels again."""

    async def main() -> None:
        event = asyncio.Event()
        swallowed = 0
        rounds_after = 0

        async def keeper() -> None:
            nonlocal swallowed, rounds_after
            while True:
                try:
                    await asyncio.wait_for(event.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1  # what 3.11's wait_for did: the cancel is lost, the loop goes on
                event.clear()
                if swallowed:
                    rounds_after += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(keeper())
        await asyncio.sleep(0.05)
        stop = asyncio.create_task(cancel_and_wait([task]))
        ended, _ = await asyncio.wait({stop}, timeout=10)  # waits without cancelling the stop
        if not ended:
            for _ in range(2):  # end the keeper for good, then fail
                task.cancel()
                await asyncio.wait({task}, timeout=1)
            stop.cancel()
            await asyncio.wait({stop, task})
        assert stop in ended, "the stop never ended: the keeper swallowed the cancel and looped on"
        assert task.cancelled()
        assert swallowed == 1 and rounds_after > 1, "the first cancel was swallowed and the loop ran on"

    asyncio.run(main())


def test_ended_and_ordinary_tasks_end_at_once() -> None:
    """cancel_and_wait over a task already done, a sleeping one and a quick one returns at once, the sleeper
    cancelled."""
    async def main() -> None:
        done = asyncio.create_task(asyncio.sleep(0))
        await done
        sleeping = asyncio.create_task(asyncio.sleep(60))
        quick = asyncio.create_task(asyncio.sleep(0))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await cancel_and_wait([done, sleeping, quick])
        assert sleeping.cancelled() and loop.time() - started < 0.5

    asyncio.run(main())


def test_await_grant_returns_the_grant_times_out_by_giving_up_and_undoes_a_grant_it_cannot_take() -> None:
    """``await_grant``: a grant in time is the result; at the deadline the request gives up and
    the result is None; a caller cancelled before the grant gives up, one cancelled just after it
    undoes the grant (a reservation nobody would take back otherwise)."""
    from kvbroker.broker.aio import await_grant

    async def run() -> None:
        loop = asyncio.get_running_loop()
        gave_up: list[str] = []
        undone: list[int] = []

        granted = loop.create_future()
        loop.call_later(0.01, granted.set_result, 7)
        assert await await_grant(granted, 5, give_up=lambda: gave_up.append("a"), undo=undone.append) == 7

        late = loop.create_future()
        assert await await_grant(late, 0.02, give_up=lambda: gave_up.append("b"), undo=undone.append) is None
        assert late.cancelled() and gave_up == ["b"]

        waiting = loop.create_future()
        task = asyncio.ensure_future(await_grant(waiting, 5, give_up=lambda: gave_up.append("c"), undo=undone.append))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gave_up == ["b", "c"]

        racing = loop.create_future()
        task = asyncio.ensure_future(await_grant(racing, 5, give_up=lambda: gave_up.append("d"), undo=undone.append))
        await asyncio.sleep(0.01)
        racing.set_result(9)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert undone == [9] and gave_up == ["b", "c"]

    asyncio.run(run())
