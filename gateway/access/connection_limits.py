"""Two limits uvicorn's HTTP/1.1 protocol lacks: a deadline for receiving a request, and a cap on open sockets.

uvicorn times out a kept-alive connection only between requests. A client that connects and sends nothing,
sends half a header, or trickles its body a byte at a time holds its socket for ever (1,500 such sockets
were all still open after 70 s), and `limit_concurrency` only answers requests whose headers are complete,
so it never counts them either. This subclass of uvicorn's h11 protocol runs a timer while a request is
being received: armed when the connection opens and when a later request's first byte arrives, disarmed
once the request's last byte is in. When it fires the client gets a 408 and the connection closes. A
connection accepted while the server already holds `max_connections` gets a 503 and is closed at once.

It leans on uvicorn's H11Protocol internals (`conn`, `cycle`, `connections`), which the tests exercise.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Their states while a request is partly received: nothing of it yet, or its headers but not all its body.
RECEIVING = (h11.IDLE, h11.SEND_BODY)


@dataclass(frozen=True)
class ConnectionLimits:
    read_timeout_seconds: float   # from the connection's start, or a later request's first byte, to its last
    max_connections: int          # open sockets per listening server, idle and half-sent ones included


class LimitedH11Protocol(H11Protocol):
    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Answered before reading anything: a socket over the cap must not cost a parse or a timer.
            self._answer(503, f"the server holds its limit of {self.limits.max_connections} connections; retry",
                         "server_error", "too_many_connections")
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        # A kept-alive connection's next request starts its deadline with its first byte; between requests
        # uvicorn's keep-alive timeout applies instead.
        if self.read_deadline is None and self.conn.their_state in RECEIVING:
            self._arm()
        super().data_received(data)
        if self.conn.their_state not in RECEIVING:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request that uvicorn picks up only now may be waiting on a body that never comes.
        if self.read_deadline is None and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.read_deadline = self.loop.call_later(self.limits.read_timeout_seconds, self._expired)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _expired(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The handler waiting for the rest of the body reads a disconnect and stops; what it answers
            # then goes nowhere (uvicorn drops a disconnected cycle's messages).
            cycle.disconnected = True
            cycle.message_event.set()
        self._answer(408, f"the request was not received within {self.limits.read_timeout_seconds:g}s",
                     "invalid_request_error", "request_timeout")

    def _answer(self, status: int, message: str, kind: str, code: str) -> None:
        """An OpenAI-style error, when no response has begun on this connection, and then close it."""
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(body))), ("connection", "close")]
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            head = h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase)
            try:
                for event in (head, h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass   # a response h11 will not frame (to a HEAD request, say): the close alone says it
        self.transport.close()
