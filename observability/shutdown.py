"""Stopping a gRPC service on SIGTERM (what Kubernetes sends) without losing its last spans."""

from __future__ import annotations

import asyncio
import signal

from observability import tracing


async def serve_until_sigterm(server, grace: float = 2.0, before_stop=None) -> None:
    """Wait for SIGTERM (Ctrl-C cancels the wait the same way), await `before_stop()` if given (a drain),
    then stop `server`, letting calls in flight finish for `grace` seconds, and flush the spans still
    batched for export."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
        if before_stop is not None:
            await before_stop()
    finally:
        await server.stop(grace=grace)
        tracing.shutdown()
