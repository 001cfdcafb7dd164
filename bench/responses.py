#!/usr/bin/env python3
"""The Responses API (docs/api.md#the-responses-api): a conversation's second turn by previous_response_id against
the same turn with the whole history resent, and whether the SDK accepts every streamed event sequence.

The stack is the embedded model (SmolLM2-135M-Instruct) as processes. `--conversations` (8) conversations, each
a distinct first question answered with `--answer-tokens` (160, greedy) tokens, run twice over: one copy goes on by
previous_response_id, the other resends its history as input items (the first question, the answer's text,
the new question) with store off. Both second turns are streamed, and their TTFTs compared: second_turn_ttft_ratio
is the median over conversations of previous_response_id's over the resent history's. Then `--streams` (24)
streams through the SDK's own stream helper (`client.responses.stream`): plain text, a JSON schema, a named
function call; valid_events is the fraction whose events it folded without an error into a response whose text
is the text of the deltas.

Prints a table and `RESULT responses second_turn_ttft_ratio=<...> valid_events=<...>`.
Usage: bench/responses.py [--conversations 8] [--answer-tokens 160] [--streams 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

from determinism import cpu_model  # noqa: E402

from launcher.processes import Service, Stack  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "mountains", "a library", "bread", "trains", "the moon", "gardens", "music", "rain", "bridges",
          "bees", "winter"]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def ttft(client, **ask) -> float:
    t0 = time.perf_counter()
    with client.responses.stream(**ask) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                return time.perf_counter() - t0
    return float("nan")


def valid(client, ask: dict) -> bool:
    """The SDK folded every event without an error, and the response it ends with has the deltas' text. A response
    cut by max_output_tokens ends with response.incomplete, whose response the SDK fills from its own snapshot
    (its get_final_response wants response.completed, as with OpenAI's own incomplete responses)."""
    try:
        with client.responses.stream(**ask) as stream:
            events = list(stream)
            final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    except Exception as e:  # noqa: BLE001 -- what the SDK refuses is what is counted
        print(f"  refused by the SDK: {type(e).__name__}: {e}")
        return False
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return final.output_text == deltas and final.status in ("completed", "incomplete")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=160)
    ap.add_argument("--streams", type=int, default=24)
    a = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit("the embedded model is not prepared: make model")
    import openai

    from executor_service.engine.runner_config import default_dtype

    name = MODEL.name
    with tempfile.TemporaryDirectory() as tmp:
        services = [Service("executor", flags={"--model": MODEL, "--kv-cache-memory": 512 << 20}),
                    Service("scheduler", flags={"--metrics-address": ""}),
                    Service("gateway", flags={"--model": MODEL})]
        with Stack(services, tmp) as stack:
            c = openai.OpenAI(base_url=stack["gateway"].url + "/v1", api_key="unused", max_retries=0)
            c.responses.create(model=name, input="Hello.", max_output_tokens=4)          # warm the shapes
            by_id, resent, cached, resent_cached = [], [], [], []
            for i in range(a.conversations):
                question = f"Write a long paragraph about {TOPICS[i % len(TOPICS)]}, number {i}."
                follow = "Now give it a title."
                first = [c.responses.create(model=name, input=question, max_output_tokens=a.answer_tokens,
                                            temperature=0) for _ in range(2)]
                by_id.append(ttft(c, model=name, previous_response_id=first[0].id, input=follow, max_output_tokens=8,
                                  temperature=0))
                history = [{"role": "user", "content": question},
                           {"role": "assistant", "content": first[1].output_text},
                           {"role": "user", "content": follow}]
                resent.append(ttft(c, model=name, input=history, max_output_tokens=8, temperature=0, store=False))
                again = c.responses.create(model=name, previous_response_id=first[0].id, input=follow,
                                           max_output_tokens=1, temperature=0)
                cached.append((again.usage.input_tokens, again.usage.input_tokens_details.cached_tokens))
                same = c.responses.create(model=name, input=history, max_output_tokens=1, temperature=0, store=False)
                resent_cached.append((same.usage.input_tokens, same.usage.input_tokens_details.cached_tokens))
            asks = [dict(model=name, input="Tell me about rivers.", max_output_tokens=24, temperature=0.7),
                    dict(model=name, input="Describe a person.", max_output_tokens=60, temperature=0,
                         text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}}),
                    dict(model=name, input="What is the weather in Rome?", tools=[WEATHER], max_output_tokens=40,
                         tool_choice={"type": "function", "name": "get_weather"}, temperature=0)]
            ok = sum(valid(c, asks[i % len(asks)]) for i in range(a.streams))

    ratios = [x / y for x, y in zip(by_id, resent, strict=True)]
    print(f"cpu: {cpu_model()}  dtype: {default_dtype('cpu')}  model: {name}  conversations: {a.conversations}  "
          f"first answers: {a.answer_tokens} tokens  streams checked: {a.streams}")
    print(f"{'second turn':<32} {'TTFT p50 ms':>12}")
    print(f"{'previous_response_id':<32} {statistics.median(by_id) * 1e3:>12.1f}")
    print(f"{'whole history resent':<32} {statistics.median(resent) * 1e3:>12.1f}")
    for what, counts in (("previous_response_id", cached), ("whole history resent", resent_cached)):
        print(f"{what} prompts: {sum(t for t, _ in counts)} tokens, {sum(h for _, h in counts)} of them cached")
    print(f"RESULT responses second_turn_ttft_ratio={statistics.median(ratios):.2f} "
          f"valid_events={ok / a.streams:.3f}")


if __name__ == "__main__":
    main()
