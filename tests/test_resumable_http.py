"""Streams that survive their client's connection and their gateway, through real processes: an executor, a
scheduler and two gateways. A chat stream read part-way on one gateway and cut (by the client, or by a kill -9 of
that gateway) is resumed on the other with GET /v1/streams/{id} and the last SSE id seen: the text before the cut
and the text after it are the uncut stream's text, no character lost or repeated. Another tenant's key gets a
404, and so does a stream nobody resumed within the scheduler's grace period."""

import json
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from fleet_stack import deterministic_flags  # noqa: E402
from gateway_stack import tiny_model_with_tokenizer  # noqa: E402
from tiny_model import kv_bytes  # noqa: E402

from launcher.processes import Service, Stack, flag_dict  # noqa: E402

pytestmark = pytest.mark.processes

GRACE = 8
TENANTS = {"tenants": {"team-a": {"keys": ["sk-a"]}, "team-b": {"keys": ["sk-b"]}}}
BODY = {"model": "model", "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 96,
        "temperature": 0.0, "ignore_eos": True, "stream": True, "stop": ["zz"]}


def events(lines, limit: int | None = None):
    """(id, data) of each SSE event in `lines`, `limit` at most."""
    got, current = [], None
    for line in lines:
        if line.startswith("id: "):
            current = line[4:]
        elif line.startswith("data: "):
            got.append((current, line[6:]))
            if limit is not None and len(got) >= limit:
                break
    return got


def text_of(evs) -> str:
    out = ""
    for _, data in evs:
        if data != "[DONE]":
            out += "".join(c["delta"].get("content", "") for c in json.loads(data)["choices"])
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resumable")
    model = tiny_model_with_tokenizer(tmp / "model", max_position_embeddings=1024)   # room for a tools prompt
    (tmp / "tenants.json").write_text(json.dumps(TENANTS))
    # A stream still open a fraction of a second after SIGTERM is cut (and kept for its client to resume).
    gateway = {"--model": model, "--tenants-file": tmp / "tenants.json", "--shutdown-grace-seconds": 0.3}
    services = [Service("executor", flags={"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(1024),
                                           "--max-num-seqs": 8, "--max-model-len": 1024, "--threads": 1,
                                           # a resubmitted stream is recomputed in a batch of another shape
                                           **flag_dict(deterministic_flags())}),
                # Long enough for a gateway killed under a loaded machine to come back (its client resumes there).
                Service("scheduler", flags={"--resume-grace-seconds": GRACE}),
                Service("gateway", "a", flags=dict(gateway)), Service("gateway", "b", flags=dict(gateway))]
    with Stack(services, tmp) as s:
        with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=BODY,
                          headers={"Authorization": "Bearer sk-a"}, timeout=60) as r:
            whole = events(r.iter_lines())
        assert whole[-1][1] == "[DONE]" and all(i is not None for i, d in whole[:-1])
        yield s, text_of(whole)


def start(s, gateway: str, n: int):
    """A stream on `gateway`, cut by its client after `n` events: (stream id, last event id, text so far)."""
    with httpx.stream("POST", s[gateway].url + "/v1/chat/completions", json=BODY,
                      headers={"Authorization": "Bearer sk-a"}, timeout=60) as r:
        evs = events(r.iter_lines(), n)
        # Known from the headers, before any event: a client whose gateway dies before the first one resumes too.
        assert r.headers["x-stepwire-stream-id"] == json.loads(evs[0][1])["id"]
    return json.loads(evs[0][1])["id"], evs[-1][0], text_of(evs)


def resume(s, gateway: str, stream_id: str, last: str | None, key: str = "sk-a"):
    headers = {"Authorization": f"Bearer {key}"} | ({"Last-Event-ID": last} if last is not None else {})
    return httpx.get(s[gateway].url + f"/v1/streams/{stream_id}", headers=headers, timeout=60)


def test_a_stream_its_client_cut_is_resumed_on_another_gateway_with_nothing_lost_or_repeated(stack):
    s, whole = stack
    sid, last, before = start(s, "a", 4)
    r = resume(s, "b", sid, last)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    after = [(i, d) for i, d in events(r.text.splitlines())]
    assert after[-1][1] == "[DONE]"
    assert before + text_of(after) == whole and before and text_of(after)
    assert all(json.loads(d)["id"] == sid for _, d in after[:-1])


def test_a_stream_whose_gateway_was_killed_is_resumed_on_the_other(stack):
    s, whole = stack
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=BODY,
                      headers={"Authorization": "Bearer sk-a"}, timeout=60) as r:
        it = r.iter_lines()
        seen, last, sid = [], None, None
        for line in it:
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: "):
                seen.append((last, line[6:]))
                sid = sid or json.loads(line[6:])["id"]
                if len(seen) == 3:
                    s.kill("a")                 # the gateway dies mid-stream
                    break
    r = resume(s, "b", sid, last)
    assert r.status_code == 200
    assert text_of(seen) + text_of(events(r.text.splitlines())) == whole
    s.start("a")
    s.wait_ready("a")


def test_another_tenants_key_and_an_unknown_id_get_a_404_and_a_late_resume_too(stack):
    s, whole = stack
    sid, last, before = start(s, "a", 2)
    assert resume(s, "b", sid, last, key="sk-b").status_code == 404
    assert resume(s, "b", "chatcmpl-" + "0" * 32, None).status_code == 404
    time.sleep(GRACE + 1)
    late = resume(s, "b", sid, last)
    assert late.status_code == 404 and late.json()["error"]["code"] == "stream_not_found"


def test_a_resume_from_the_start_replays_the_whole_stream(stack):
    s, whole = stack
    sid, _, _ = start(s, "a", 1)
    r = resume(s, "b", sid, None)
    evs = events(r.text.splitlines())
    assert text_of(evs) == whole
    assert json.loads(evs[0][1])["choices"][0]["delta"].get("role") == "assistant"


def test_the_projects_client_resumes_on_its_own_when_its_gateway_is_killed_and_comes_back(stack):
    from launcher.resuming_stream import stream_chat

    s, whole = stack
    parts = []
    for i, text in enumerate(stream_chat(s["a"].url, BODY, {"Authorization": "Bearer sk-a"}, attempts=8)):
        parts.append(text)
        if i == 3:
            s.kill("a")                 # the gateway dies mid-stream, and comes back on its port
            s.start("a")
    s.wait_ready("a")
    assert "".join(parts) == whole


def test_a_grpc_stream_is_resumed_on_another_gateway_from_its_last_sequence(stack):
    grpc = pytest.importorskip("grpc")
    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc

    s, _ = stack
    key = (("authorization", "Bearer sk-a"),)
    request = g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content="Count to twenty.")]),
                                params=g.SamplingParameters(max_tokens=96, temperature=0.0, ignore_eos=True,
                                                            stop=["zz"]))
    with grpc.insecure_channel(s["a"].address) as a, grpc.insecure_channel(s["b"].address) as b:
        whole = "".join(m.text for m in generation_pb2_grpc.GenerationStub(a).GenerateStream(request, metadata=key))
        call = generation_pb2_grpc.GenerationStub(a).GenerateStream(request, metadata=key)
        stream_id = dict(call.initial_metadata())["x-stepwire-stream-id"]
        seen = [next(call) for _ in range(3)]
        call.cancel()                                   # the client's connection broke
        assert all(m.id == stream_id for m in seen)
        rest = list(generation_pb2_grpc.GenerationStub(b).Resume(
            g.ResumeRequest(id=stream_id, after=seen[-1].sequence), metadata=key))
        assert "".join(m.text for m in seen + rest) == whole
        assert rest[-1].finish_reason and rest[-1].usage.completion_tokens == 96
        with pytest.raises(grpc.RpcError) as refused:
            list(generation_pb2_grpc.GenerationStub(b).Resume(g.ResumeRequest(id=stream_id),
                                                              metadata=(("authorization", "Bearer sk-b"),)))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_documented_openai_sdk_snippet_resumes_a_stream(stack):
    """docs/resumable_streams.md's snippet, as written there."""
    openai = pytest.importorskip("openai")
    s, whole = stack
    client = openai.OpenAI(base_url=s["a"].url + "/v1", api_key="sk-a")
    messages = BODY["messages"]
    extra = {"ignore_eos": True}
    # --- the snippet ---
    text, stream_id, last = "", None, None
    with client.chat.completions.with_streaming_response.create(
            model="model", messages=messages, max_tokens=96, temperature=0.0, stop=["zz"], stream=True,
            extra_body=extra) as response:
        stream_id = response.headers["x-stepwire-stream-id"]
        for n, line in enumerate(response.iter_lines()):
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if n == 8:
                break                                  # say the connection broke here
    # ... and on any gateway, the rest:
    with httpx.stream("GET", f"{s['b'].url}/v1/streams/{stream_id}", timeout=60,
                      headers={"Authorization": "Bearer sk-a", "Last-Event-ID": last}) as rest:
        for line in rest.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    # --- end of the snippet ---
    assert text == whole


def logprobs_of(evs) -> list[tuple[str, float, list[str]]]:
    """(token, logprob, top tokens) of every token the events cover."""
    out = []
    for _, data in evs:
        if data != "[DONE]":
            for c in json.loads(data)["choices"]:
                for t in (c.get("logprobs") or {}).get("content", []):
                    out.append((t["token"], t["logprob"], [top["token"] for top in t["top_logprobs"]]))
    return out


def test_a_stream_with_logprobs_is_resumed_with_every_tokens_logprobs_once(stack):
    s, whole = stack
    body = BODY | {"logprobs": True, "top_logprobs": 2}
    headers = {"Authorization": "Bearer sk-a"}
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        uncut = logprobs_of(events(r.iter_lines()))
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        sid = r.headers["x-stepwire-stream-id"]
        seen = events(r.iter_lines(), 5)
    rest = events(resume(s, "b", sid, seen[-1][0]).text.splitlines())
    assert text_of(seen) + text_of(rest) == whole
    got = logprobs_of(seen) + logprobs_of(rest)
    assert len(got) == len(uncut) == 96
    assert [t for t, _, _ in got] == [t for t, _, _ in uncut]
    assert all(len(top) == 2 for _, _, top in got)
    assert all(abs(a - b) < 0.05 for (_, a, _), (_, b, _) in zip(got, uncut, strict=True))


def tool_calls_of(evs) -> tuple[dict, str | None]:
    """{index: [id, name, arguments]} added up from the events' tool-call pieces, and the finish reason."""
    calls, reason = {}, None
    for _, data in evs:
        if data != "[DONE]":
            for c in json.loads(data)["choices"]:
                reason = c.get("finish_reason") or reason
                for piece in c["delta"].get("tool_calls", []):
                    call = calls.setdefault(piece["index"], [None, None, ""])
                    if "id" in piece:
                        assert call[0] is None, "a call is announced once"
                        call[0], call[1] = piece["id"], piece["function"]["name"]
                    call[2] += piece["function"]["arguments"]
    return calls, reason


def test_a_stream_of_tool_calls_cut_mid_call_is_resumed_with_the_same_calls_and_ids(stack):
    s, _ = stack
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}
    body = {"model": "model", "messages": [{"role": "user", "content": "Weather in Paris and the time in Oslo?"}],
            "max_tokens": 200, "temperature": 0.0, "stream": True, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": n, "parameters": schema}}
                      for n in ("get_weather", "get_time")]}
    headers = {"Authorization": "Bearer sk-a"}
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        uncut, uncut_reason = tool_calls_of(events(r.iter_lines()))
    assert uncut and uncut_reason == "tool_calls" and all(c[1] in ("get_weather", "get_time") for c in uncut.values())
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        sid = r.headers["x-stepwire-stream-id"]
        seen = events(r.iter_lines(), 6)
    rest = events(resume(s, "b", sid, seen[-1][0]).text.splitlines())
    calls, reason = tool_calls_of(seen + rest)
    assert tool_calls_of(seen)[0], "cut after a call had begun"
    assert {i: c[1:] for i, c in calls.items()} == {i: c[1:] for i, c in uncut.items()} and reason == "tool_calls"
    # The ids follow from the stream's id: a call announced after the break is named as the first gateway would.
    from gateway.tools.calls import tool_plan
    from gateway.tools.parser import ToolCallParser
    named = ToolCallParser(tool_plan(body["tools"], "required", None), call_ids=sid)
    for i, (cid, _, _) in calls.items():
        named.calls = [None] * i
        assert cid == named._call_id()


def texts_by_choice(evs, n: int) -> list[str]:
    out = [""] * n
    for _, data in evs:
        if data != "[DONE]":
            for c in json.loads(data)["choices"]:
                out[c["index"]] += c["delta"].get("content") or ""
    return out


def test_a_stream_of_three_completions_is_resumed_with_each_ones_text_whole(stack):
    s, _ = stack
    body = BODY | {"n": 3, "temperature": 0.9, "seed": 11}
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer sk-a"}, timeout=60) as r:
        sid = r.headers["x-stepwire-stream-id"]
        seen = events(r.iter_lines(), 10)
    last = seen[-1][0]
    assert len(last.split(".")) == 3           # one count per completion
    assert resume(s, "b", sid, "4").status_code == 400, "an id that names one completion of three"
    assert resume(s, "b", sid, "1.x.2").status_code == 400 and resume(s, "b", sid, "-2.0.0").status_code == 400
    rest = events(resume(s, "b", sid, last).text.splitlines())
    assert rest[-1][1] == "[DONE]"
    # The last id says all three ended.
    assert all(int(part) % 2 == 1 for part in rest[-2][0].split("."))
    # The whole stream, as the scheduler kept it (it ended; kept for the grace period): each completion's text
    # before the break and after it add up to it.
    replay = events(resume(s, "a", sid, None).text.splitlines())
    whole = texts_by_choice(replay, 3)
    assert len(set(whole)) == 3 and all(whole)      # seeded: three different completions
    assert [a + b for a, b in zip(texts_by_choice(seen, 3), texts_by_choice(rest, 3), strict=True)] == whole


def test_a_grpc_stream_of_two_completions_is_resumed_from_each_ones_last_sequence(stack):
    grpc = pytest.importorskip("grpc")
    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc

    s, _ = stack
    key = (("authorization", "Bearer sk-a"),)
    request = g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content="Count to twenty.")]),
                                params=g.SamplingParameters(max_tokens=96, temperature=0.9, seed=5, ignore_eos=True,
                                                            n=2))
    with grpc.insecure_channel(s["a"].address) as a, grpc.insecure_channel(s["b"].address) as b:
        call = generation_pb2_grpc.GenerationStub(a).GenerateStream(request, metadata=key)
        stream_id = dict(call.initial_metadata())["x-stepwire-stream-id"]
        seen = [next(call) for _ in range(5)]
        call.cancel()
        after = [0, 0]
        for m in seen:
            after[m.index] = m.sequence
        rest = list(generation_pb2_grpc.GenerationStub(b).Resume(g.ResumeRequest(id=stream_id, after_each=after),
                                                                 metadata=key))
        whole = ["", ""]
        for m in generation_pb2_grpc.GenerationStub(a).Resume(g.ResumeRequest(id=stream_id), metadata=key):
            whole[m.index] += m.text
        got = ["", ""]
        for m in seen + rest:
            got[m.index] += m.text
        assert got == whole and whole[0] != whole[1] and rest[-1].usage.completion_tokens == 192


def test_a_browser_eventsource_may_name_the_last_event_in_the_query_and_the_header_wins(stack):
    s, whole = stack
    sid, last, before = start(s, "a", 4)
    r = httpx.get(s["b"].url + f"/v1/streams/{sid}", params={"last_event_id": last},
                  headers={"Authorization": "Bearer sk-a"}, timeout=60)
    assert r.status_code == 200 and before + text_of(events(r.text.splitlines())) == whole
    # A reconnect of EventSource sends the header too, with a later id: that one counts.
    sid, last, before = start(s, "a", 4)
    r = httpx.get(s["b"].url + f"/v1/streams/{sid}", params={"last_event_id": "0"},
                  headers={"Authorization": "Bearer sk-a", "Last-Event-ID": last}, timeout=60)
    assert r.status_code == 200 and before + text_of(events(r.text.splitlines())) == whole


def test_a_gateway_stopped_by_sigterm_cuts_a_long_stream_after_its_grace_and_the_client_resumes_it_elsewhere(stack):
    """A rolling restart: the stream does not hold the old gateway up, and it goes on, whole, on another."""
    s, _ = stack
    body = BODY | {"max_tokens": 900}
    seen, cut = [], False
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer sk-a"}, timeout=60) as r:
        sid = r.headers["x-stepwire-stream-id"]
        last = None
        try:
            for line in r.iter_lines():
                if line.startswith("id: "):
                    last = line[4:]
                elif line.startswith("data: "):
                    seen.append((last, line[6:]))
                    if len(seen) == 3:
                        s.terminate("a")
        except (httpx.TransportError, httpx.RemoteProtocolError):
            cut = True
    # It exits on its own once the grace is over (uvicorn hands the signal on once it has stopped: -15).
    assert s.wait("a") in (0, -signal.SIGTERM)
    assert (cut or seen[-1][1] != "[DONE]") and len(seen) >= 3
    rest = events(resume(s, "b", sid, seen[-1][0]).text.splitlines())
    assert rest[-1][1] == "[DONE]"
    whole = text_of(events(resume(s, "b", sid, None).text.splitlines()))
    assert text_of(seen) + text_of(rest) == whole and len(whole) > 900
    s.start("a")
    s.wait_ready("a")


def test_a_stream_resubmitted_to_a_restarted_scheduler_stays_resumable_with_every_token_once(stack):
    """The scheduler is killed mid-stream: the gateway submits the request again (its journal), under the stream's
    id, and the new scheduler's record starts with the tokens the client already had; then the client's connection
    breaks, and a resume on the other gateway gets the rest."""
    s, _ = stack
    body = BODY | {"max_tokens": 900}
    seen, last = [], None
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer sk-a"}, timeout=120) as r:
        sid = r.headers["x-stepwire-stream-id"]
        for line in r.iter_lines():
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: "):
                seen.append((last, line[6:]))
                if len(seen) == 1:
                    s.kill("scheduler")
                    s.start("scheduler")
                if len(seen) == 40:
                    break                       # the client's connection breaks
    assert seen[-1][1] != "[DONE]"
    rest = events(resume(s, "b", sid, last).text.splitlines())
    assert rest[-1][1] == "[DONE]"
    text = text_of(seen) + text_of(rest)
    # Greedy: the same text as a run that nothing interrupted.
    with httpx.stream("POST", s["a"].url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer sk-a"}, timeout=120) as r:
        assert text == text_of(events(r.iter_lines()))
