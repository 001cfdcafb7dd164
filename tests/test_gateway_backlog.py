"""A gateway that falls behind the scheduler sends what piled up for a completion as one delta, so a busy
gateway spends less per token instead of falling further behind; one that keeps up sends a delta per step.
The deltas carry every token, its text and its logprobs either way."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gateway_stack import EMBEDDED

from gateway.generation.backend import Backend
from gateway.generation.params import GenerationParams, Usage
from gateway.text.tokenizer import ModelTokenizer
from stepwire.contract import SamplingParams
from stepwire.internal import scheduler_pb2

if not (EMBEDDED / "tokenizer.json").exists():
    pytest.skip("the embedded model is not prepared (make model)", allow_module_level=True)

TOKENS = [19556, 28, 905, 314, 253, 1345, 30, 378, 4115, 2067]   # ordinary words of the embedded vocabulary


class FakeSession:
    """Hands the backend one queue per submit, filled by the test as the scheduler's deltas would be."""

    def __init__(self):
        self.queues: list[asyncio.Queue] = []
        self.ended: list[tuple[str, bool]] = []

    def submit(self, request) -> asyncio.Queue:
        self.queues.append(asyncio.Queue())
        return self.queues[-1]

    def done(self, request_id: str, abort: bool, detach: bool = False, queue=None) -> None:
        self.ended.append((request_id, abort))


def delta(tok: int, last: bool) -> scheduler_pb2.RequestOutput:
    lp = scheduler_pb2.TokenLogprobs(token_ids=[tok], logprobs=[-0.5])
    return scheduler_pb2.RequestOutput(token_ids=[tok], finish_reason="length" if last else "", logprobs=[lp])


async def stream(tokenizer, feed) -> tuple[list, FakeSession]:
    backend = Backend(grpc.aio.insecure_channel("127.0.0.1:1"), tokenizer, "m")
    backend.session = session = FakeSession()
    params = GenerationParams(sampling=SamplingParams(max_tokens=len(TOKENS), temperature=0.0, logprobs=0))
    chunks = []

    async def consume():
        async for c in backend.generate([1, 2, 3], params, Usage()):
            chunks.append(c)
            await asyncio.sleep(0)     # the HTTP side's write

    task = asyncio.create_task(consume())
    while not session.queues:
        await asyncio.sleep(0)
    await feed(session.queues[0])
    await asyncio.wait_for(task, 10)
    return chunks, session


def test_deltas_that_pile_up_go_out_as_one_and_lose_nothing():
    tokenizer = ModelTokenizer(EMBEDDED)

    async def all_at_once(q):     # a gateway busy for the length of ten steps
        for i, t in enumerate(TOKENS):
            q.put_nowait(delta(t, i == len(TOKENS) - 1))

    chunks, session = asyncio.run(stream(tokenizer, all_at_once))
    assert len(chunks) < len(TOKENS)
    assert [t for c in chunks for t in c.token_ids] == TOKENS
    assert "".join(c.text for c in chunks) == tokenizer.decode(TOKENS)
    assert [lp[0][0] for c in chunks for lp in c.logprobs] == TOKENS
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert session.ended and not session.ended[0][1], "a finished request was aborted"


def test_a_gateway_that_keeps_up_sends_a_delta_per_step():
    tokenizer = ModelTokenizer(EMBEDDED)

    async def one_per_step(q):
        for i, t in enumerate(TOKENS):
            q.put_nowait(delta(t, i == len(TOKENS) - 1))
            for _ in range(20):        # the next step comes long after this one went out
                await asyncio.sleep(0)

    chunks, _ = asyncio.run(stream(tokenizer, one_per_step))
    assert [c.token_ids for c in chunks] == [[t] for t in TOKENS]
    assert "".join(c.text for c in chunks) == tokenizer.decode(TOKENS)
