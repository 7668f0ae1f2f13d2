"""Running the proxy, and its front door: `ProxyServer` binds it to a port, announces it in a run-info file so
`harness sql` can find it (harness/store/live.py), stops it cleanly, and is all that code running a proxy needs
of it (its store, flushing, opening episodes, sampling overrides, the weight version).

DuckDB lets one process hold a database file; while the proxy runs, queries go through its read-only SQL route.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from aiohttp import web

from harness.store.database import Store
from harness.store.live import info_path, write_info
from proxy.app import create_app
from proxy.config import ProxyConfig, SamplingOverrides
from proxy.state import EPISODES, RECORDER, STATE, STORE


class ProxyServer:
    """The proxy app on a socket, and the front door for code that runs one (`harness run`, the trainer, verl's
    agent loop): its store, flushing the recorder, opening an episode, sampling overrides, the weight version.
    Nothing outside proxy/ touches the app's keys. `start()`/`stop()` in a running loop, or `start_in_thread()` for
    a sync caller."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.app = create_app(config)
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._unix_path: str | None = None
        self._unix_lock = asyncio.Lock()

    @property
    def run_id(self) -> str:
        return self.app[STATE].run_id

    @property
    def store(self) -> Store:
        """The store the proxy records into (reads are safe from any thread)."""
        return self.app[STORE]

    def flush(self) -> None:
        """Write every call recorded so far to the store (blocks; from a thread, not the proxy's loop)."""
        self.app[RECORDER].flush()

    async def open_episode(self, episode_id: str, meta: dict) -> dict:
        """Open a new episode for an agent about to run (on the proxy's loop): {"episode_id", "base_url",
        "api_key"} as `POST /harness/episodes` answers."""
        return await self.app[EPISODES].open(episode_id, source="runner", meta=meta, new=True)

    @property
    def episodes_forgotten(self) -> int:
        """Episodes dropped from memory so far (past ProxyConfig.max_episodes; their calls stay recorded)."""
        return self.app[EPISODES].evicted

    @property
    def sampling(self) -> SamplingOverrides | None:
        """The sampling overrides in force: the config's, until `use_sampling` swaps them."""
        return self.app[STATE].sampling

    def use_sampling(self, sampling: SamplingOverrides | None) -> None:
        """Serve the calls from now on with `sampling` (None: the config's again); a trainer switches to greedy or
        validation sampling and back."""
        self.app[STATE].sampling = sampling if sampling is not None else self.config.sampling

    @property
    def weight_version(self) -> int:
        """The policy version that calls are recorded with (`calls.weight_version`)."""
        return self.app[STATE].weight_version

    @property
    def info_path(self) -> Path:
        return info_path(self.config.db_path)

    async def start(self) -> str:
        # handler_cancellation: an agent that disconnects cancels its handler, and with it the engine request.
        # auto_decompress off: the proxy refuses compressed bodies itself (proxy/http_json.py read_body), where
        # aiohttp's decoder could answer a corrupt one with a 500 or leave its connection hanging.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        self._write_info()
        return self.url

    async def unix_socket(self) -> str:
        """The path of a unix socket the started proxy also serves on (made at the first call, removed at stop):
        sandboxes, which have no network of their own, reach the proxy through it (harness/sandbox/bwrap.py)."""
        async with self._unix_lock:  # episodes starting at once share one
            if self._unix_path is None:
                path = os.path.join(tempfile.mkdtemp(prefix="hx-proxy-"), "proxy.sock")  # short: at most 107 bytes
                await web.UnixSite(self._runner, path).start()
                self._unix_path = path
        return self._unix_path

    async def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.info_path.unlink()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._unix_path is not None:
            shutil.rmtree(os.path.dirname(self._unix_path), ignore_errors=True)
            self._unix_path = None

    def _write_info(self) -> None:
        write_info(self.config.db_path, {"url": self.url, "pid": os.getpid(), "run_id": self.run_id,
                                         "db_path": str(self.config.db_path), "admin_token": self.config.admin_token})

    # A sync caller (tests, the demo) runs the proxy on its own loop in a thread.
    def start_in_thread(self, timeout_s: float = 60.0, *, spawns: bool = False) -> str:
        """Start the proxy on a loop of its own in a thread; `spawns`: that loop starts agent processes too
        (new_event_loop)."""
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
            self._loop = new_event_loop(spawns)
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
    settle_gc()
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


LOOP_ENV = "HARNESS_EVENT_LOOP"


def loop_kind() -> str:
    """Which event loop the proxy runs on: "uvloop" when it is installed (the core requires it on Linux and
    macOS), "asyncio" when not or when HARNESS_EVENT_LOOP=asyncio. On one core uvloop carries ~5% more calls a
    second and a slightly lower tail (docs/BENCHMARKS.md, proxy_overhead); everything the proxy does runs on
    either. A value that names neither is a ValueError naming it."""
    asked = os.environ.get(LOOP_ENV, "").strip().lower()
    if asked not in ("", "uvloop", "asyncio"):
        raise ValueError(f"{LOOP_ENV}={os.environ[LOOP_ENV]!r} is not an event loop: set uvloop or asyncio, or "
                         "unset it (uvloop when installed)")
    if asked == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if asked == "uvloop":
            raise ValueError(f"{LOOP_ENV}=uvloop but uvloop is not installed: pip install uvloop, or unset "
                             f"{LOOP_ENV}") from None
        return "asyncio"
    return "uvloop"


def new_event_loop(spawns: bool = False) -> asyncio.AbstractEventLoop:
    """A new event loop of `loop_kind()`; asyncio's for a loop that also starts agent processes (`spawns`: harness
    run's and the trainer's). uvloop forks a child itself and runs the parent's at-fork handlers in it, and the
    children of a process that has run torch and tokenizers then die of a segmentation fault before they start
    (tests/running/test_spawning.py); asyncio starts them by CPython's subprocess, which runs no Python code in
    the child."""
    if loop_kind() == "uvloop" and not spawns:
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(coro, spawns: bool = False):
    """`asyncio.run(coro)` on the proxy's event loop (new_event_loop(spawns))."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(spawns)) as runner:
        return runner.run(coro)


def settle_gc() -> None:
    """The collector tuned for a process that is the proxy: what start-up made (modules, the app, DuckDB's
    Python side) is frozen out of every later collection, and the youngest generation is collected every 20,000
    new objects instead of 700. A call allocates a few hundred short-lived objects that reference counting frees;
    at the default threshold the collector ran every few calls and took 12-15% of the proxy's CPU
    (docs/BENCHMARKS.md, the profile of proxy_overhead); cyclic garbage still goes, a little later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
