"""A cap on HTTP request bodies, with or without Content-Length (chunked too), read no further than the cap.

Starlette has a limiter of its own, but it answers an announced overrun with a plain-text body that cannot
be swapped for OpenAI's {"error": {...}} shape (it replaces whatever response the app sends); this one
answers a declared overrun at once and turns a streamed one into an HTTPException, which the app's
handler words like every other refusal.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(status_code=413, detail="Content Too Large")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, too_large: Callable[[], Response]):
        self.app = app
        self.max_bytes = max_bytes
        self.too_large = too_large

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            # Refused before a byte of the body is read.
            await self.too_large()(scope, receive, send)
            return
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()   # FastAPI passes an HTTPException from the body read on as it is
            return message

        await self.app(scope, receive_within_limit, send)
