"""The processes under test in the load soak (bench/soak.py): the scripted engine with a toy /tokenize and a count
of what it served per episode, `harness serve` in a process of its own, and reading a process's RSS and CPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
import zlib
from collections import Counter, deque
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from proxy.scripted_engine import Script, ScriptedEngine
from proxy.upstreams import EPISODE_HEADER

ROOT = Path(__file__).resolve().parents[1]
DB_MEMORY_MB = 64  # the proxy's DuckDB cap in the soak (`harness serve --db-memory-mb`): its memory may not exceed it
EPISODE_PREFIX = "soak-"  # the soak's own episodes (not the probe call `harness serve` makes when it attaches)
_READY = re.compile(r"proxy ready: (http://\S+?)/v1\b")
# ---------------------------------------------------------------------------------------------------------------
# The engine side: the scripted engine, a toy /tokenize, and a count of what it served per episode.
# ---------------------------------------------------------------------------------------------------------------


class _Received:
    """Stands in for ScriptedEngine.requests: counts the bodies received instead of keeping them (a long soak
    would hold every request body in memory)."""

    def __init__(self):
        self.count = 0

    def append(self, body) -> None:
        self.count += 1

    def __len__(self) -> int:
        return self.count


_ROLES = {"system": 11, "user": 12, "assistant": 13, "tool": 14}
_CLOSE, _NL = 2, 3  # the toy template's turn end: close token, then a newline


def toy_render(messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """A chat template in miniature: each message is [role, one id per word, close, newline]; append-only, so the
    proxy's splice (proxy/splice.py) works on it as on Qwen's template."""
    ids: list[int] = []
    for m in messages:
        content = m.get("content") or ""
        if not isinstance(content, str):
            content = orjson.dumps(content).decode()
        ids.append(_ROLES.get(m.get("role"), 15))
        ids.extend(20 + zlib.crc32(word.encode()) % 30000 for word in content.split())
        ids += [_CLOSE, _NL]
    if add_generation_prompt:
        ids.append(_ROLES["assistant"])
    return ids


class SoakEngine:
    """The scripted engine plus /tokenize, counting the chat and completions answers it finished per episode."""

    def __init__(self, script: Script):
        self.engine = ScriptedEngine(script)
        self.engine.requests = _Received()
        self.served: Counter[str] = Counter()  # episode -> engine answers finished (200, stream ended)
        self.served_by_route: Counter[str] = Counter()
        self.tokenized = 0
        self.engine.app.middlewares.append(self._count)
        self.engine.app.router.add_post("/tokenize", self._tokenize)

    @web.middleware
    async def _count(self, request: web.Request, handler):
        resp = await handler(request)  # a stream has been written to its end when the handler returns
        route = request.path.rsplit("/v1/", 1)[-1]
        if route in ("chat/completions", "completions") and resp.status == 200:
            episode = request.headers.get(EPISODE_HEADER, "")
            if episode.startswith(EPISODE_PREFIX):
                self.served[episode] += 1
                self.served_by_route[route] += 1
        return resp

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.tokenized += 1
        ids = toy_render(body.get("messages") or [], bool(body.get("add_generation_prompt", True)))
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    @property
    def received(self) -> int:
        return len(self.engine.requests)


# ---------------------------------------------------------------------------------------------------------------
# The proxy: `harness serve` in its own process.
# ---------------------------------------------------------------------------------------------------------------


class ProxyProcess:
    def __init__(self, proc: asyncio.subprocess.Process, url: str, log: deque, reader: asyncio.Task, db: Path):
        self.proc, self.url, self.log, self._reader = proc, url, log, reader
        # `harness serve` writes its URL and admin token next to the database (docs/proxy.md)
        self.admin_token = json.loads(db.with_name(db.name + ".proxy.json").read_text())["admin_token"]

    @classmethod
    async def start(cls, upstream: str, db: Path, run_dir: Path, timeout_s: float = 60.0) -> ProxyProcess:
        cmd = [sys.executable, "-m", "harness.cli", "serve", "--upstream", upstream, "--db", str(db),
               "--port", "0", "--run-dir", str(run_dir), "--db-memory-mb", str(DB_MEMORY_MB)]
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        log: deque[str] = deque(maxlen=2000)
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def read():  # keeps draining stderr so the proxy never blocks on a full pipe
            async for raw in proc.stderr:
                line = raw.decode(errors="replace").rstrip()
                log.append(line)
                m = _READY.search(line)
                if m and not ready.done():
                    ready.set_result(m.group(1))
            if not ready.done():
                ready.set_exception(RuntimeError("harness serve exited before it was ready:\n" + "\n".join(log)))

        reader = asyncio.create_task(read())
        try:
            url = await asyncio.wait_for(ready, timeout_s)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        return cls(proc, url, log, reader, db)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def duckdb_memory_mb(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """DuckDB's own accounting of its memory in the proxy (buffer pool by tag), through the SQL route."""
        sql = "SELECT tag, memory_usage_bytes FROM duckdb_memory() WHERE memory_usage_bytes > 0"
        async with session.post(self.url + "/harness/sql", data=orjson.dumps({"sql": sql}),
                                headers={"Authorization": f"Bearer {self.admin_token}",
                                         "Content-Type": "application/json"}) as resp:
            rows = (await resp.json())["rows"] if resp.status == 200 else []
        return {tag: round(b / 2**20, 1) for tag, b in rows}

    async def pending_records(self, session: aiohttp.ClientSession) -> int:
        """Records the proxy's recorder has taken and not yet written (its `/harness/status`)."""
        async with session.get(self.url + "/harness/status",
                               headers={"Authorization": f"Bearer {self.admin_token}"}) as resp:
            return int((await resp.json())["pending_records"])

    async def stop(self, timeout_s: float = 60.0) -> tuple[int, float]:
        """SIGINT, as a user's Ctrl-C: the proxy flushes its recorder and exits. Returns (exit code, seconds)."""
        t0 = time.monotonic()
        if self.proc.returncode is not None:  # it died on its own
            return self.proc.returncode, 0.0
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            code = -9
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reader, 5)
        return code, time.monotonic() - t0


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """utime + stime of a process, in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


