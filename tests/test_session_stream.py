"""The scheduler's side of a gateway's Session stream: which deltas go out, in which message, and when it ends."""

import asyncio
from types import SimpleNamespace

from scheduler_service.api.gateway_sessions import Session
from scheduler_service.core.output import RequestDelta


def test_deltas_that_arrive_while_a_message_is_written_go_out_before_the_stream_ends():
    async def run():
        session = Session(SimpleNamespace(streams={}))
        session.live |= {"a", "b"}
        session.closed = True                       # the gateway has half-closed: end once both finished
        session.put_nowait(RequestDelta("a", [1], None, 0))
        messages = session.messages()
        first = await anext(messages)
        # While that message is on its way, both requests finish: `live` empties with their deltas pending.
        session.put_nowait(RequestDelta("a", [2], "length", 0))
        session.put_nowait(RequestDelta("b", [7], "stop", 0))
        rest = [m async for m in messages]
        return first, rest

    first, rest = asyncio.run(run())
    assert [(o.request_id, list(o.token_ids)) for o in first.outputs] == [("a", [1])]
    assert [[(o.request_id, list(o.token_ids), o.finish_reason) for o in m.outputs] for m in rest] == \
        [[("a", [2], "length"), ("b", [7], "stop")]]


def test_a_stopping_scheduler_sends_what_is_pending_and_says_so_in_the_last_message():
    async def run():
        session = Session(SimpleNamespace(streams={}))
        session.live.add("a")
        session.put_nowait(RequestDelta("a", [4, 5], None, 0))
        session.shut_down()
        return [m async for m in session.messages()]

    (last,) = asyncio.run(run())
    assert last.shutting_down and [list(o.token_ids) for o in last.outputs] == [[4, 5]]
