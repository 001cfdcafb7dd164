"""A resume's takeover at the gateway (gateway/generation/resumed.py), with the scheduler's answers scripted: a
client that comes back through the same gateway while the first call still carries its stream gets, first, the
outputs the scheduler had sent before its replay; the takeover reads past them to the replay, which holds their
tokens too (found by bench/gateway_chaos.py: such a resume was a 500)."""

import asyncio
import json

import pytest

from gateway.access.tenants import DEFAULT
from gateway.generation.resumed import _take
from gateway.generation.scheduler_session import SchedulerError
from stepwire.internal import scheduler_pb2


class ScriptedSession:
    def __init__(self, outputs):
        self.outputs, self.ended = outputs, []

    def resume(self, rid, tenant):
        q = asyncio.Queue()
        for o in self.outputs:
            q.put_nowait(o)
        return q

    def done(self, rid, abort, detach=False, queue=None):
        self.ended.append((rid, abort))


class Backend:
    def __init__(self, session):
        self.session = session


def test_a_takeover_reads_past_outputs_sent_before_the_replay():
    context = json.dumps({"n": 1}).encode()
    session = ScriptedSession([scheduler_pb2.RequestOutput(request_id="s", token_ids=[7]),
                               scheduler_pb2.RequestOutput(request_id="s", token_ids=[5, 7, 9], replay=True,
                                                           resume_context=context)])
    rid, _, first = asyncio.run(_take(Backend(session), "s", DEFAULT))
    assert rid == "s" and first.replay and list(first.token_ids) == [5, 7, 9] and first.resume_context == context
    assert session.ended == []


def test_a_takeover_refused_by_the_scheduler_raises_its_error_and_lets_go():
    refused = scheduler_pb2.RequestOutput(request_id="s", error=scheduler_pb2.RequestError(code=5, message="no"))
    session = ScriptedSession([scheduler_pb2.RequestOutput(request_id="s", token_ids=[7]), refused])
    with pytest.raises(SchedulerError) as refused_here:
        asyncio.run(_take(Backend(session), "s", DEFAULT))
    assert refused_here.value.code().name == "NOT_FOUND"
    assert session.ended == [("s", False)]


def test_a_gateway_whose_session_broke_takes_its_request_back_with_only_what_its_client_has_not_had():
    from types import SimpleNamespace

    from gateway.generation.backend import Backend as RealBackend
    from gateway.generation.journal import Entry

    entry = Entry("s", [1, 2], None, 0, "", "", None, None, delivered=[5, 7], resume_context=b"{}")
    replay = scheduler_pb2.RequestOutput(request_id="s", token_ids=[5, 7, 9, 11], replay=True, resume_context=b"{}")
    for pairs in ([(5, -0.1)], [(7, -0.2)], [(9, -0.3)], [(11, -0.4)]):
        replay.logprobs.add(token_ids=[t for t, _ in pairs], logprobs=[v for _, v in pairs])
    session = ScriptedSession([scheduler_pb2.RequestOutput(request_id="s", token_ids=[9]), replay])
    _, rest = asyncio.run(RealBackend._reclaim(SimpleNamespace(session=session), entry))
    assert list(rest.token_ids) == [9, 11] and [list(lp.token_ids) for lp in rest.logprobs] == [[9], [11]]
    # Where the scheduler holds no such request (a new scheduler), there is nothing to take back: it is resubmitted.
    refused = scheduler_pb2.RequestOutput(request_id="s", error=scheduler_pb2.RequestError(code=5, message="no"))
    session = ScriptedSession([refused])
    assert asyncio.run(RealBackend._reclaim(SimpleNamespace(session=session), entry)) == (None, None)
    assert session.ended == [("s", False)]
