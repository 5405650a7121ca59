"""The pipeline's channels (``refit/handoff.py``): order, bounds, the end of input, and a failed stage never
read as the end of input — on the asyncio fast path and on the anyio ``Event`` path other backends take."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from refitflow.refit.handoff import channel, give, take


@pytest.fixture(params=["future", "event"])
def make(request, monkeypatch):
    """``channel``, on the asyncio path (futures) or the one other backends take (anyio events)."""

    def made(size: int):
        send, receive = channel(size)
        if request.param == "event":
            send._st.loop = None
        return send, receive

    return made


@pytest.mark.asyncio
async def test_items_pass_in_order_and_the_end_of_input_follows_the_last(make) -> None:
    send, receive = make(2)
    got: list[int] = []

    async def consumer() -> None:
        async with receive:
            while (x := await take(receive)) is not None:
                got.append(x)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            async with send:
                for i in range(100):
                    await give(send, i)
    assert got == list(range(100))


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, 1, 3])
async def test_a_sender_waits_while_the_channel_holds_size_items(make, size: int) -> None:
    send, receive = make(size)
    given = 0

    async def producer() -> None:
        nonlocal given
        for i in range(size + 2):
            await give(send, i)
            given += 1

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            while send.statistics()[0] < size + 1:  # every slot, and the item it waits to hand over
                await anyio.lowlevel.checkpoint()
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            assert given == size and send.statistics() == (size + 1, size)
            assert await take(receive) == 0
            while given < size + 1:
                await anyio.lowlevel.checkpoint()
            assert await take(receive) == 1
            tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_sender_that_failed_breaks_its_receiver_instead_of_ending_its_input(make) -> None:
    send, receive = make(4)
    with anyio.fail_after(5):
        with pytest.raises(RuntimeError):
            async with send:
                await give(send, 1)
                raise RuntimeError("stage failed")
        with pytest.raises(anyio.BrokenResourceError):
            await take(receive)


@pytest.mark.asyncio
async def test_a_receiver_that_closed_breaks_its_waiting_sender(make) -> None:
    send, receive = make(0)

    async def closer() -> None:
        while not send.statistics()[0]:
            await anyio.lowlevel.checkpoint()
        await receive.aclose()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(closer)
            with pytest.raises(anyio.BrokenResourceError):
                await give(send, 1)
        with pytest.raises(anyio.BrokenResourceError):
            await give(send, 2)


@pytest.mark.asyncio
async def test_a_stage_waiting_on_a_sender_that_fails_is_broken_not_ended(make) -> None:
    """The failed sender's exit wakes the stage waiting for input (before the task group cancels it): it ends
    broken (an echo), never with the end of its input."""
    send, receive = make(1)
    outcome: list[str] = []
    waiting = anyio.Event()

    async def upstream() -> None:
        async with send:
            await waiting.wait()
            await anyio.lowlevel.checkpoint()  # the stage is waiting in take
            raise RuntimeError("stage failed")

    async def downstream() -> None:
        try:
            waiting.set()
            outcome.append("ended" if await take(receive) is None else "took")
        except anyio.get_cancelled_exc_class():
            outcome.append("cancelled")
            raise
        except anyio.BrokenResourceError:
            outcome.append("broken")

    with anyio.fail_after(5), pytest.raises(ExceptionGroup) as caught:
        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream)
            tg.start_soon(downstream)
    assert outcome == ["broken"]
    assert [type(e) for e in caught.value.exceptions] == [RuntimeError]


@pytest.mark.asyncio
async def test_a_cancelled_stage_whose_sender_failed_is_cancelled_not_broken(make) -> None:
    """Cancelled with its sender (a refit cancelled from outside), a stage ends cancelled: a group of echoes
    alone must read as the cancellation it is."""
    send, receive = make(1)
    with anyio.fail_after(5):
        with anyio.CancelScope() as scope:
            send.abort()
            scope.cancel()
            await take(receive)
    assert scope.cancelled_caught
