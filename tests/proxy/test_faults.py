"""Faults a long run meets, injected for real: the engine process SIGKILLed mid-stream and started again, and the
disk under the database filling up. The engine is the scripted one (a real HTTP server in a process of its own,
so it can be killed); agents are real subprocesses using the openai SDK; the proxy and DuckDB are real."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from harness.core.records import Task
from harness.running.dataset import run_dataset
from harness.running.runner import RunConfig
from harness.running.vllm_server import attach
from tests.support import RunningProxy, db_rows

ROOT = Path(__file__).resolve().parents[2]

# The scripted engine in a process of its own; every request it starts adds a line to the marker file.
ENGINE = textwrap.dedent('''
    import asyncio, pathlib, sys
    from aiohttp import web
    from proxy.scripted_engine import Script, ScriptedEngine

    async def main():
        port, marker = int(sys.argv[1]), pathlib.Path(sys.argv[2])
        engine = ScriptedEngine(Script(chunk_delay_s=0.1, completion_tokens=20))

        @web.middleware
        async def mark(request, handler):
            if request.method == "POST":
                with marker.open("a") as f:
                    f.write(request.path + "\\n")
            return await handler(request)

        engine.app.middlewares.append(mark)
        await engine.start(port=port)
        await asyncio.Event().wait()

    asyncio.run(main())
''')

# Two streamed turns, no SDK retries: an error reaches the agent, which crashes with it.
AGENT = textwrap.dedent('''
    import json, sys
    from openai import OpenAI
    task = json.loads(sys.stdin.read())
    client = OpenAI(max_retries=0, timeout=30)
    for turn in range(2):
        stream = client.chat.completions.create(model="gpt-4o-mini", stream=True, max_tokens=20,
                                                messages=[{"role": "user", "content": f"turn {turn}"}])
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    print(json.dumps({"answer": task["answer"]}))
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    def __init__(self, tmp_path: Path):
        self.port, self.marker = _free_port(), tmp_path / "engine-requests.txt"
        self.script = tmp_path / "engine.py"
        self.script.write_text(ENGINE)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(self.script), str(self.port), str(self.marker)], cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                assert self.proc.poll() is None, "the scripted engine exited at start"
                time.sleep(0.05)
        raise TimeoutError("the scripted engine did not start listening")

    def requests_started(self) -> int:
        return len(self.marker.read_text().splitlines()) if self.marker.exists() else 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


async def test_engine_killed_mid_stream_and_back_the_run_goes_on(tmp_path):
    """The engine dies with streams open and comes back 2 s later. Agents get an OpenAI-style error (their streams
    end with an error event; calls meanwhile get a 502); the episodes it hit are recorded as `infra_error`, with
    the broken calls marked `engine_fault`, and retried; every task ends finished and judged correct."""
    engine = EngineProcess(tmp_path)
    engine.start()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    tasks = [Task(f"t{i}", {"answer": str(i)}) for i in range(8)]
    config = RunConfig(command=[sys.executable, str(agent)], judge="exact_match", concurrency=4, timeout_s=60,
                       retries=3)
    run = asyncio.create_task(run_dataset(tasks, config, attach(engine.url), tmp_path / "run", progress=False))
    try:
        while engine.requests_started() < 3:  # streams of 2 s each are open
            assert not run.done(), run
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        engine.kill()
        killed_at = time.monotonic()
        await asyncio.sleep(2.0)
        engine.start()
        run_id, report = await asyncio.wait_for(run, 240)
    finally:
        run.cancel()
        if engine.proc.poll() is None:
            engine.kill()
    db = tmp_path / "run" / "harness.duckdb"
    assert report["mean_reward"] == 1.0 and report["episodes"] == 8, report
    finals = db_rows(db, "SELECT task_id, arg_max(status, attempt) FROM episode_outcomes GROUP BY task_id")
    assert sorted(finals) == [(f"t{i}", "finished") for i in range(8)]
    hit = db_rows(db, "SELECT episode_id, error FROM episode_outcomes WHERE status = 'infra_error'")
    assert hit, "no episode was marked as hit by the engine's death"
    # the agent's own error: the SDK's APIError carrying the proxy's message (a long traceback is kept by its head
    # and tail, so one of the two shows)
    assert all("engine was unreachable" in error and ("APIError" in error or "/v1/chat/completions is unreachable"
                                                       in error) for _, error in hit), hit
    broken = db_rows(db, "SELECT episode_id, error FROM calls WHERE extra->>'engine_fault' = 'stream_broke_off'")
    assert broken and {e for e, _ in broken} <= {e for e, _ in hit}, (broken, hit)
    errors = db_rows(db, "SELECT episode_id, http_status, extra->>'engine_fault' FROM calls WHERE status <> 'ok'")
    assert all(code in (502, 503, 504) or fault for _, code, fault in errors), errors  # each one the engine's
    assert {e for e, _, _ in errors} <= {e for e, _ in hit}  # and its episode marked
    judged = db_rows(db, "SELECT count(*), count(DISTINCT episode_id) FROM judgements")
    assert judged == [(8, 8)]  # the final attempts only
    assert time.monotonic() - killed_at < 240


def _mount_small_disk(path: Path, size_mb: int) -> None:
    path.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode != 0:  # not root, or no CAP_SYS_ADMIN: the disk cannot be made small
        pytest.skip(f"cannot mount a {size_mb} MB tmpfs to fill: {out.stderr.strip()}")


async def test_disk_full_under_the_database_is_a_clear_503_and_nothing_is_lost(upstream, tmp_path):
    """The database's disk fills while agents call. Calls answered before the recorder noticed are held in
    memory; new calls get a 503 `storage_full` naming the file; once space is freed everything held lands, calls
    are taken again, and the closed database holds every answered call exactly once, spilling nothing."""
    disk = tmp_path / "disk"
    _mount_small_disk(disk, 4)
    try:
        filler = disk / "filler"
        proxy = RunningProxy(upstream.url, disk / "harness.duckdb", record_batch=1, record_delay_s=0.0)
        try:
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            filler.write_bytes(b"\0" * max(0, free - 700_000))  # ~0.7 MB left
            answered, refused = [], None
            big = {"model": "gpt-4o-mini", "max_tokens": 4,
                   "messages": [{"role": "user", "content": os.urandom(24_000).hex()}]}  # incompressible
            async with aiohttp.ClientSession() as s:
                for i in range(200):
                    async with s.post(proxy.url + f"/e/full-{i % 5}/v1/chat/completions", json=big) as r:
                        body = await r.json()
                        if r.status == 503:
                            refused = body
                            break
                        assert r.status == 200, body
                        answered.append(body["id"])
                assert refused is not None, f"{len(answered)} calls and the disk never filled"
                assert refused["error"]["code"] == "storage_full", refused
                assert str(disk / "harness.duckdb") in refused["error"]["message"]
                async with s.get(proxy.url + "/harness/status", headers=proxy.admin_headers) as r:
                    status = await r.json()
                assert "No space left on device" in status["disk_full"], status
                # reads still work, on what is written
                async with s.post(proxy.url + "/harness/sql", headers=proxy.admin_headers,
                                  json={"sql": "SELECT count(*) FROM calls"}) as r:
                    assert r.status == 200, await r.text()
                filler.unlink()
                deadline = time.monotonic() + 30
                while status["disk_full"] or status["pending_records"]:
                    assert time.monotonic() < deadline, status
                    await asyncio.sleep(0.2)
                    async with s.get(proxy.url + "/harness/status", headers=proxy.admin_headers) as r:
                        status = await r.json()
                async with s.post(proxy.url + "/e/full-0/v1/chat/completions", json=big) as r:
                    assert r.status == 200, await r.text()
                    answered.append((await r.json())["id"])
        finally:
            proxy.close()
        assert len(answered) >= 3
        rows = db_rows(disk / "harness.duckdb", "SELECT count(*), count(DISTINCT call_id), "
                       "count(*) FILTER (WHERE status = 'ok'), sum(length(request)) FROM calls")
        assert rows[0][:3] == (len(answered), len(answered), len(answered)), (rows, len(answered))
        assert rows[0][3] > 48_000 * len(answered)  # every request whole
        indexes = db_rows(disk / "harness.duckdb", "SELECT episode_id, list(call_index ORDER BY call_index) "
                          "FROM calls GROUP BY 1 ORDER BY 1")
        assert all(ix == list(range(len(ix))) for _, ix in indexes), indexes
        assert not list(disk.glob("*.spill.jsonl"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
