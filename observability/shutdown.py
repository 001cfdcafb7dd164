"""Stopping a gRPC service on SIGTERM (what Kubernetes sends) without losing its last spans."""

from __future__ import annotations

import asyncio
import signal

from observability import tracing


async def serve_until_sigterm(server, grace: float = 2.0, before_stop=None, failed: asyncio.Event | None = None
                              ) -> None:
    """Wait for SIGTERM (Ctrl-C cancels the wait the same way), await `before_stop()` if given (a drain),
    then stop `server`, letting calls in flight finish for `grace` seconds, and flush the spans still
    batched for export. If `failed` is set first, the service cannot go on: no drain and no grace."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, failed) if e is not None]
    broken = False
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        broken = failed is not None and failed.is_set()
        if before_stop is not None and not broken:
            await before_stop()
    finally:
        for w in waits:
            w.cancel()
        await server.stop(grace=0 if broken else grace)
        tracing.shutdown()
