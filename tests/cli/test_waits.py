"""Every wait past a few seconds says what it waits for, on a terminal or not (issue 48, item 3), and a URL that is
not an engine is named as such, without its page's bytes (item 5): the commands run as a user types them, under a
pipe as nohup and CI run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from harness.running.vllm_server import Engine, EngineError, _wait_until_serving, last_log_line
from tests.support import TERSE, BackgroundApp, ScriptedUpstream

_PAGE = ("<!DOCTYPE html>\n<html><head><title>My  Wiki\n</title><script>alert(1)</script></head>"
         "<body><h1>Welcome</h1>" + "lorem ipsum " * 200 + "</body></html>")


def _harness(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _html_site() -> BackgroundApp:
    """A web server that answers every path with an HTML page, as a wiki or a dashboard would."""
    async def page(request: web.Request) -> web.Response:
        return web.Response(text=_PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    return BackgroundApp(app)


def _refusal(done: subprocess.CompletedProcess, url: str) -> str:
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: --upstream ") and url in err, err
    assert "answered 200 with text/html" in err and "not an OpenAI-compatible API" in err, err
    assert "give the engine's base URL (e.g. http://host:8000/v1)" in err, err
    assert "'My Wiki'" in err, err  # the page's title, whitespace folded: a short, printable excerpt
    assert "<" not in err.split("API")[0] and "lorem" not in err and "alert" not in err, err
    return err


def test_run_against_an_html_page_names_the_url_and_records_nothing(tmp_path):
    site = _html_site()
    try:
        done = _harness("run", str(TERSE / "agent.py"), "--data", str(TERSE / "tasks.jsonl"),
                        "--upstream", site.url, "--run-dir", str(tmp_path / "run"))
    finally:
        site.close()
    assert done.returncode == 2, done.stderr
    _refusal(done, site.url)
    assert not (tmp_path / "run" / "harness.duckdb").exists()  # refused before the proxy opened a database
    assert not (tmp_path / "run" / "episodes").exists()  # and before any agent ran


def test_serve_against_an_html_page_names_the_url_and_records_nothing(tmp_path):
    site = _html_site()
    try:
        done = _harness("serve", "--upstream", f"{site.url}/wiki/", "--run-dir", str(tmp_path / "run"), "--port", "0")
    finally:
        site.close()
    assert done.returncode == 1, done.stderr
    _refusal(done, f"{site.url}/wiki/")
    assert not (tmp_path / "run" / "harness.duckdb").exists()


def _run_under_a_pipe(agent: Path, limit: int, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`harness run AGENT` on the first `limit` terse tasks against the scripted engine, its stderr a pipe; the
    finished run and its progress lines."""
    upstream = ScriptedUpstream()
    try:
        done = _harness("run", str(agent), "--data", str(TERSE / "tasks.jsonl"), "--limit", str(limit),
                        "--judge", f"{TERSE / 'judge.py'}:terse", "--upstream", upstream.url,
                        "--run-dir", str(tmp_path / "run"))
    finally:
        upstream.close()
    assert done.returncode == 0, done.stderr
    return done, [line for line in done.stderr.splitlines() if line.startswith("episodes ")]


def test_run_under_a_pipe_prints_plain_progress_lines(tmp_path):
    """No terminal (capture_output is a pipe): one plain line per finished episode of a short run (and, on a machine
    slow enough that no episode ends within 10 s, the heartbeat's line saying so), no bar, no terminal control
    codes; the report follows on stdout."""
    done, lines = _run_under_a_pipe(TERSE / "agent.py", 3, tmp_path)
    done_counts = [int(line.split("/", 1)[0].removeprefix("episodes ")) for line in lines]
    assert [line.split(",")[0] for line in lines] == [f"episodes {n}/3 done" for n in done_counts], lines
    assert sorted(set(done_counts) - {0}) == [1, 2, 3] and done_counts == sorted(done_counts), lines
    assert ", 0 running, reward mean " in lines[-1] and ", 0 failed, " in lines[-1], lines
    assert "\x1b" not in done.stderr and "\r" not in done.stderr
    assert "━" not in done.stderr  # rich's bar is for terminals only


def test_run_under_a_pipe_says_so_every_10_s_while_no_episode_ends(tmp_path):
    """An agent that works 11 s before it answers: before its episode ends, the heartbeat's plain line says that
    none is done and one is running."""
    agent = tmp_path / "slow_agent.py"
    agent.write_text('import json, time\ntime.sleep(11)\nprint(json.dumps({"answer": "done"}))\n')
    _, lines = _run_under_a_pipe(agent, 1, tmp_path)
    assert lines[0].startswith("episodes 0/1 done, 1 running, reward mean -, 0 failed, "), lines
    assert lines[-1].startswith("episodes 1/1 done, 0 running, "), lines


def test_the_engine_log_line_shown_is_vllms_latest_word():
    log = ("INFO 12-02 00:12:30 [__init__.py:216] Automatically detected platform cpu.\n"
           "(APIServer pid=4242) INFO 12-02 00:12:34 [gpu_model_runner.py:2602] Loading weights took 0.52 seconds\n"
           "Loading safetensors checkpoint shards:   0% Completed | 0/1\r"
           "Loading safetensors checkpoint shards: 100% Completed | 1/1\r\n\n   \n")
    assert last_log_line(log) == "Loading safetensors checkpoint shards: 100% Completed | 1/1"
    assert last_log_line(log.rsplit("Loading safetensors", 2)[0]) == "Loading weights took 0.52 seconds"
    assert last_log_line("WARNING 12-02 00:12:30 [x.py:1] " + "y" * 300).endswith("…")
    assert last_log_line("") == ""


def test_a_slow_engine_start_says_how_far_it_is(tmp_path):
    """The wait for vLLM names its pid, the time waited, the log and vLLM's latest line, then fails with the log's
    tail once the process exits. A stand-in process plays the slow engine: it logs a step, waits until the wait has
    said something, logs another and exits, so no clock decides what the test sees."""
    log_path, told = tmp_path / "engine.log", tmp_path / "told"
    log_path.write_text("earlier engine's last words\n")
    start = log_path.stat().st_size
    script = ("import pathlib, sys, time\n"
              "print('INFO 12-02 00:00:01 [loader.py:1] Loading weights took 0.50 seconds', flush=True)\n"
              f"while not pathlib.Path({str(told)!r}).exists(): time.sleep(0.05)\n"
              "print('ERROR 12-02 00:00:02 [core.py:9] out of memory', flush=True)\n"
              "sys.exit(3)\n")
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if "Loading weights" in line:
            told.touch()

    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    engine = Engine("http://127.0.0.1:9", "m", True, log_path=log_path, _log_start=start)
    try:
        _wait_until_serving(engine, process, 600, say=say, every_s=0.2)
    except EngineError as exc:
        failure = str(exc)
    finally:
        process.kill()
        process.wait()
    assert said and said[0].startswith(f"engine: starting vLLM (pid {process.pid}), "), said
    assert f"log {log_path} (last log line: " in said[0] or "(nothing logged yet)" in said[0], said
    assert any(line.endswith("(last log line: Loading weights took 0.50 seconds)") for line in said), said
    assert "vLLM exited with code 3 before serving" in failure and "out of memory" in failure
    assert "earlier engine's last words" not in failure  # only this engine's part of the appended log
