"""Slow and idle HTTP clients cannot hold the gateway's sockets: a request must arrive whole (headers and body)
within --read-timeout-seconds, or the client gets a 408 and the connection closes; past --max-connections
open sockets a new connection gets a 503 and is closed at once. Others are served meanwhile.

Before these limits, 1,500 connections that had sent half a header were all still held after 70 s.
"""

import json
import select
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from gateway_stack import tiny_stack  # noqa: E402

READ_TIMEOUT = 2      # seconds, the gateway's --read-timeout-seconds here
MAX_CONNECTIONS = 300
SLOW = 200            # half-sent requests held at once, well past what a few workers would survive
HANG = 60             # seconds: far above the deadline, far below "for ever"
HALF_A_HEADER = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: appl"
COMPLETION = {"model": "model", "prompt": "Hello", "max_tokens": 2}


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("slow"), ["--read-timeout-seconds", str(READ_TIMEOUT),
                                                      "--max-connections", str(MAX_CONNECTIONS)]) as s:
        yield s


def connect(stack) -> socket.socket:
    host, port = stack.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=HANG)


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a close)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return data


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def request(path: str, body: bytes = b"", method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_many_half_sent_headers_get_a_408_and_are_closed_while_others_are_served(stack):
    slow = [connect(stack) for _ in range(SLOW)]
    for s in slow:
        s.sendall(HALF_A_HEADER)
    r = httpx.post(stack.url + "/v1/completions", json=COMPLETION, timeout=HANG)
    assert r.status_code == 200, r.text
    for s in slow:
        status, error = status_and_error(answer(s))
        assert status == 408 and error["code"] == "request_timeout", error


def test_a_connection_that_sends_nothing_is_closed_after_the_deadline(stack):
    status, _ = status_and_error(answer(connect(stack)))
    assert status == 408


def test_a_trickled_body_is_cut_before_it_is_complete(stack):
    body = json.dumps(COMPLETION).encode()
    s = connect(stack)
    s.sendall(request("/v1/completions", body)[:-len(body)])
    sent = 0
    # A byte every 0.2 s would take far longer than the deadline to finish the body.
    while sent < len(body) and not select.select([s], [], [], 0.2)[0]:
        try:
            s.sendall(body[sent:sent + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 1
    raw = answer(s)
    assert sent < len(body)
    assert raw == b"" or status_and_error(raw)[0] == 408, raw


def test_a_kept_alive_connection_may_idle_between_requests_past_the_deadline(stack):
    s = connect(stack)
    for _ in range(2):
        s.sendall(request("/v1/models", method="GET"))
        assert read_response(s).startswith(b"HTTP/1.1 200"), "the deadline cut a connection between requests"
        # Past the read deadline, within uvicorn's keep-alive timeout (5 s): only the latter applies here.
        time.sleep(READ_TIMEOUT + 1)
    s.close()


def test_each_request_on_a_kept_alive_connection_has_a_deadline_of_its_own(stack):
    s = connect(stack)
    s.sendall(request("/v1/models", method="GET"))
    assert read_response(s).startswith(b"HTTP/1.1 200")
    s.sendall(HALF_A_HEADER)
    status, _ = status_and_error(answer(s))
    assert status == 408


def test_connections_past_the_cap_get_a_503_and_are_closed_and_then_the_gateway_serves(stack):
    extra = 20
    sockets = [connect(stack) for _ in range(MAX_CONNECTIONS + extra)]
    # Held ones answer 408 at their deadline, refused ones 503 at once: every socket is closed either way.
    statuses = [status_and_error(answer(s))[0] for s in sockets]
    assert set(statuses) <= {408, 503}
    assert statuses.count(503) >= extra
    assert statuses.count(408) <= MAX_CONNECTIONS
    r = httpx.post(stack.url + "/v1/completions", json=COMPLETION, timeout=HANG)
    assert r.status_code == 200, r.text
