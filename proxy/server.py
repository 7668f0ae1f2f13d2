"""Running the proxy: bound to a port, announced in a run-info file so `harness sql` can find it, stopped cleanly.

DuckDB lets one process hold a database file; while the proxy runs, queries go through its read-only SQL route.
The run-info file `<db>.proxy.json` (mode 0600: it holds the admin token) tells other processes where that is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import urllib.request
from pathlib import Path

from aiohttp import web

from proxy.app import STATE, create_app
from proxy.config import ProxyConfig


def info_path(db_path: str | Path) -> Path:
    db_path = Path(db_path)
    return db_path.with_name(db_path.name + ".proxy.json")


def discover(db_path: str | Path, timeout_s: float = 2.0) -> dict | None:
    """The live proxy that owns `db_path`, or None if none answers."""
    path = info_path(db_path)
    try:
        info = json.loads(path.read_text())
        with urllib.request.urlopen(info["url"] + "/health", timeout=timeout_s) as resp:
            health = json.loads(resp.read())
    except (OSError, ValueError, KeyError):
        return None
    return info if health.get("run_id") == info.get("run_id") else None


class ProxyServer:
    """The proxy app on a socket. `start()`/`stop()` in a running loop, or `start_in_thread()` for a sync caller."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.app = create_app(config)
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def run_id(self) -> str:
        return self.app[STATE].run_id

    @property
    def info_path(self) -> Path:
        return info_path(self.config.db_path)

    async def start(self) -> str:
        # handler_cancellation: an agent that disconnects cancels its handler, and with it the engine request.
        # auto_decompress off: the proxy refuses compressed bodies itself (proxy/errors.py read_body), where
        # aiohttp's decoder could answer a corrupt one with a 500 or leave its connection hanging.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        self._write_info()
        return self.url

    async def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.info_path.unlink()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _write_info(self) -> None:
        info = {"url": self.url, "pid": os.getpid(), "run_id": self.run_id, "db_path": str(self.config.db_path),
                "admin_token": self.config.admin_token}
        path = self.info_path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)

    # A sync caller (tests, the demo) runs the proxy on its own loop in a thread.
    def start_in_thread(self, timeout_s: float = 60.0) -> str:
        ready = threading.Event()
        errors: list[BaseException] = []

        async def main():
            self._stopped = asyncio.Event()
            try:
                await self.start()
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                return
            ready.set()
            await self._stopped.wait()
            await self.stop()

        def run():
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(main())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="harness-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"the proxy did not start within {timeout_s} s")
        if errors:
            raise errors[0]
        return self.url

    def call(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the proxy's loop (started with start_in_thread) and wait for its result: code that
        shares the proxy's objects (the store, the episode table) runs where they live."""
        if self._loop is None:
            raise RuntimeError("the proxy is not running in a thread: call start_in_thread() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop_thread(self, timeout_s: float = 60.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(timeout_s)
        self._thread = None


async def serve_forever(config: ProxyConfig, on_ready=None) -> None:
    """Serve until SIGINT / SIGTERM; everything recorded is flushed before returning."""
    server = ProxyServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
    finally:
        await server.stop()
