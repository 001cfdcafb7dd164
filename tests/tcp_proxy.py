"""A loopback TCP proxy in front of one service, for network faults a test switches on: while `stall_new` is set,
connections opened from then on are accepted and never answered (a transfer that stalls), while the ones
already open go on."""

import asyncio
import contextlib
import socket
import threading


class Proxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.stall_new = False
        self.stalled = 0                      # connections held without an answer
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def main():
            self._server = await asyncio.start_server(self._serve, sock=self._sock)
            ready.set()
            async with self._server:
                await self._server.serve_forever()

        with contextlib.suppress(asyncio.CancelledError, RuntimeError):
            self._loop.run_until_complete(main())

    async def _serve(self, reader, writer) -> None:
        if self.stall_new:
            self.stalled += 1
            with contextlib.suppress(Exception):
                await reader.read()          # hold it open, read and drop, answer nothing
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)

    def close(self) -> None:
        async def stop():
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)


async def _pipe(reader, writer) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
