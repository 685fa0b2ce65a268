"""cancel_and_wait: a broker task whose loop swallowed a cancellation still ends (the stop path)."""

from __future__ import annotations

import asyncio

from kvbroker.broker.aio import cancel_and_wait


def test_a_loop_over_wait_for_that_swallowed_the_cancel_still_ends() -> None:
    """The etcd lease keeper's shape: a loop over ``wait_for(event.wait(), ...)``. The cancel lands as
    the event is set, which Python 3.11's wait_for swallows (gh-86296; a plain cancel-then-await
    waited forever, and the broker never exited on SIGTERM); cancel_and_wait cancels again."""

    async def main() -> int:
        event = asyncio.Event()
        rounds = 0

        async def keeper() -> None:
            nonlocal rounds
            while True:
                try:
                    await asyncio.wait_for(event.wait(), 5)
                except asyncio.TimeoutError:
                    pass
                event.clear()
                rounds += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(keeper())
        await asyncio.sleep(0.05)
        event.set()
        await asyncio.wait_for(cancel_and_wait([task]), 10)
        assert task.done()
        return rounds

    asyncio.run(main())


def test_ended_and_ordinary_tasks_end_at_once() -> None:
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
