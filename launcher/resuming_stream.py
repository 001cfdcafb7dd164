"""A chat stream that picks itself up: when the connection to the gateway breaks mid-stream (the network, a
gateway restarted or killed), it asks any gateway behind the same URL for the rest with GET /v1/streams/{id} and
the last SSE id it saw (docs/resumable_streams.md), so the text comes out whole, nothing lost or repeated."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx

BROKEN = (httpx.TransportError, httpx.RemoteProtocolError)
RETRIED = (502, 503, 504)


def stream_chat(url: str, body: dict, headers: dict | None = None, attempts: int = 5,
                pause: float = 0.5) -> Iterator[str]:
    """The content deltas of a streamed chat completion, resumed up to `attempts` times after a break."""
    headers = dict(headers or {})
    stream_id, last, tries = None, None, 0
    while True:
        try:
            if stream_id is None:
                call = httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=None)
            else:
                call = httpx.stream("GET", f"{url}/v1/streams/{stream_id}", timeout=None,
                                    headers=headers | ({"Last-Event-ID": last} if last is not None else {}))
            with call as r:
                if r.status_code == 404 and stream_id is not None and last is None:
                    stream_id = None     # its gateway died before the request reached the scheduler: send it again
                    continue
                if r.status_code in RETRIED:
                    # A gateway still starting, or one that lost the scheduler under the resume: try again.
                    raise httpx.RemoteProtocolError(f"{r.status_code} {r.read().decode()}")
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code} {r.read().decode()}")
                stream_id = stream_id or r.headers.get("x-stepwire-stream-id")   # known before any event
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        last = line[4:]
                    elif line == "data: [DONE]":
                        return
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:   # a server error (the gateway lost the scheduler): resumed like a break
                            if event["error"].get("type") == "server_error":
                                raise httpx.RemoteProtocolError(event["error"].get("message", ""))
                            raise RuntimeError(event["error"].get("message", ""))
                        stream_id = stream_id or event.get("id")
                        for choice in event.get("choices", []):
                            yield choice.get("delta", {}).get("content", "")
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        except BROKEN:
            tries += 1
            if tries > attempts:
                raise
            time.sleep(pause * tries)     # then the rest, or (nothing known of it yet) the request again
