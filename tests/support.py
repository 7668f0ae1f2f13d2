"""Test plumbing: run async servers on a loop of their own, so sync clients (the openai SDK) can call them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import pytest
from aiohttp import web

from proxy import ProxyConfig, ProxyServer
from proxy.scripted_engine import Script, ScriptedEngine


class BackgroundLoop:
    """An event loop in a daemon thread; `run(coro)` runs a coroutine there and returns its result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class BackgroundApp:
    """An aiohttp app on a free port of 127.0.0.1, on a loop of its own."""

    def __init__(self, app: web.Application, **runner_kwargs):
        self.bg = BackgroundLoop()

        async def start() -> web.AppRunner:
            runner = web.AppRunner(app, access_log=None, **runner_kwargs)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner

        self._runner = self.bg.run(start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def close(self):
        self.bg.run(self._runner.cleanup())
        self.bg.close()


class ScriptedUpstream:
    """The scripted engine on its own loop."""

    def __init__(self, script: Script | None = None):
        self.bg = BackgroundLoop()
        self.engine = ScriptedEngine(script)
        self.url = self.bg.run(self.engine.start())

    @property
    def script(self) -> Script:
        return self.engine.script

    def close(self):
        self.bg.run(self.engine.stop())
        self.bg.close()


class RunningProxy:
    """A proxy on a free port in a background thread, recording into `db_path`."""

    def __init__(self, upstream_url: str, db_path: Path, **overrides):
        self.config = ProxyConfig(upstream_url=upstream_url, db_path=db_path, port=0, **overrides)
        self.server = ProxyServer(self.config)
        self.url = self.server.start_in_thread()
        self.db_path = db_path

    @property
    def admin_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.config.admin_token}"}

    def close(self):
        self.server.stop_thread()


def db_rows(db_path: Path, sql: str, params=None) -> list[tuple]:
    """Read a closed database file (the proxy must be stopped)."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


TERSE = Path(__file__).resolve().parents[1] / "examples" / "terse_agent"


def record_terse_run(upstream_url: str, run_dir: Path) -> Path:
    """A real recorded run through `harness run`: 16 tasks x 2 episodes of the two-turn terse agent, judged and
    merged; returns its database."""
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(TERSE / "agent.py"), "--data",
                          str(TERSE / "tasks.jsonl"), "--judge", f"{TERSE / 'judge.py'}:terse", "--repeat", "2",
                          "--upstream", upstream_url, "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return run_dir / "harness.duckdb"


# What CI leaves out, to keep within its 45 minutes (long learning runs, the sweep over every model family): `make
# test-long` runs them.
LONG_TESTS = bool(os.environ.get("HARNESS_LONG_TESTS"))  # tests that run short in CI run whole
long_run = pytest.mark.skipif(not LONG_TESTS,
                              reason="left out of CI: make test-long (HARNESS_LONG_TESTS=1) runs it")


def running_with(marker: str) -> bool:
    """Whether a live (not zombie) process has `marker` in its command line."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path("/proc", pid, "cmdline").read_bytes():
                return Path("/proc", pid, "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            continue
    return False
