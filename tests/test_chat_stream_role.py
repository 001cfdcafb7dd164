"""A streamed chat completion's first chunk (the assistant role) goes out with the first output of its choice, not
before it: clients (vLLM's benchmark client among them) time TTFT by the first chunk."""

from __future__ import annotations

import asyncio
import json

from gateway.generation.params import Chunk, GenerationParams
from gateway.generation.telemetry import GatewayMetrics, Observation
from gateway.http_api.responses import respond


class Gated:
    """A backend whose two choices each produce one token once `go` is set."""

    max_model_len = 256
    model_name = "m"

    def __init__(self):
        self.go = asyncio.Event()

    def check(self, prompt, p):
        pass

    async def generate(self, prompt, p, usage, obs=None, request_id=None, resume_context=None):
        await self.go.wait()
        for i in range(2):
            yield Chunk(i, f"tok{i}", [7 + i])
        for i in range(2):
            yield Chunk(i, "", [], finish_reason="length")


class Raw:
    scope: dict = {}

    async def is_disconnected(self) -> bool:
        return False


class Body:
    stream = True
    stream_options = None


def test_a_chat_streams_role_chunk_comes_with_its_choices_first_token_not_before():
    async def go():
        backend = Gated()
        obs = Observation(GatewayMetrics(), "http", "/v1/chat/completions", "chat.completion", {}, "m")
        p = GenerationParams(n=2)     # respond sets the tenant: the default one, not limited
        response = await respond(backend, Raw(), Body(), [1, 2, 3], p, True, obs)
        body = response.body_iterator
        first = asyncio.ensure_future(anext(body))
        for _ in range(20):            # the stream is open; nothing may come out before the first token
            await asyncio.sleep(0)
        early = first.done()
        backend.go.set()
        events = [await first] + [e async for e in body]
        data = [e.split("data: ", 1)[1] for e in events]      # each event also has its SSE id: line first
        return early, [json.loads(d) for d in data if d.strip() != "[DONE]"]

    early, events = asyncio.run(go())
    assert not early
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events if e["choices"]]
    # Each choice's role chunk right before its own first text: choice 1's comes after choice 0's token.
    assert deltas[:4] == [(0, {"role": "assistant", "content": ""}), (0, {"content": "tok0"}),
                          (1, {"role": "assistant", "content": ""}), (1, {"content": "tok1"})]
