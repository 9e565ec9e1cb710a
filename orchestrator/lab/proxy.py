"""A loopback TCP proxy that adds a fixed delay each way (lab fault knob).

    proxy = LatencyProxy(("127.0.1.1", 22), delay_ms=50).start()
    ... connect to proxy.address ...
    proxy.stop()

Data keeps its order and is released `delay_ms` after it arrived, in each direction, so
a round trip costs 2 x delay_ms extra, like a link with that one-way latency.
"""

from __future__ import annotations

import asyncio
import threading
import time

from ..fleet.safety import LOOPBACK, check_target  # noqa: F401 - LOOPBACK documents the rule


class LatencyProxy:
    def __init__(self, target: tuple[str, int], delay_ms: float, listen: tuple[str, int] = ("127.0.0.1", 0)):
        check_target(target[0], "proxy target")
        check_target(listen[0], "proxy listen address")
        self.target = target
        self.delay = delay_ms / 1000.0
        self.listen = listen
        self.address: tuple[str, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        releaser = asyncio.ensure_future(release())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0.0, b""))
        try:
            await releaser
        except (ConnectionError, OSError):
            pass

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, server_writer),
                             self._pipe(server_reader, client_writer))

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, self.listen[0], self.listen[1]))
        self.address = self._server.sockets[0].getsockname()[:2]
        self._ready.set()
        self._loop.run_forever()
        # Stop accepting, then cancel the open connections' tasks before closing the loop.
        self._server.close()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    def start(self) -> "LatencyProxy":
        self._thread = threading.Thread(target=self._run, daemon=True, name="latency-proxy")
        self._thread.start()
        self._ready.wait(5)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
