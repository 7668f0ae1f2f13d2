"""The escape suite: an "agent" that tries every way out of its sandbox (harness/sandbox/bwrap.py), run as a real
episode of a Harbor task through the runner, the proxy and DuckDB. Every attempt must be refused, the refusals the
sandbox can see flagged on the episode, nothing outside the workspace changed; the proxy (and only it) reachable,
through the real openai SDK; the verifier's reward stored."""

from __future__ import annotations

import json
import os
import socketserver
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from harness.running import harbor
from harness.running.dataset import run_dataset
from harness.running.runner import RunConfig
from harness.running.tasks import read_tasks
from harness.running.vllm_server import attach
from tests.support import db_rows, running_with

ESCAPE = textwrap.dedent('''
    import json, os, socket, subprocess, sys, urllib.request
    from openai import OpenAI

    task = json.loads(sys.stdin.read())
    where = json.loads(task["prompt"].split("PATHS:", 1)[1])
    tried = {}

    def attempt(name, action):
        try:
            action()
            tried[name] = "done"
        except Exception as exc:
            tried[name] = f"refused: {type(exc).__name__}"

    def read(path):
        return lambda: open(path).read()

    def write(path):
        return lambda: open(path, "a").write("escaped")

    attempt("read tests", read(where["tests"] + "/test.sh"))
    attempt("list /tests", lambda: os.listdir("/tests"))
    attempt("read solution", read(where["solution"] + "/solve.sh"))
    attempt("read the run's database", read(where["db"]))
    attempt("list another episode's workspace", lambda: os.listdir(where["other_workspace"]))
    attempt("read a host file", read(where["secret"]))
    for path in ("/usr/escaped", "/etc/escaped", "/escaped", "/run/harness/escaped", where["secret"],
                 where["other_workspace"] + "/escaped"):
        attempt(f"write {path}", write(path))
    attempt("write a kernel setting", write("/proc/sys/kernel/printk_ratelimit"))
    attempt("trigger sysrq", write("/proc/sysrq-trigger"))
    tried["host secret in the environment"] = "seen" if "HARNESS_TEST_SECRET" in os.environ else "absent"
    import shutil, stat
    shutil.copy("/usr/bin/true", "suid-true")
    os.chmod("suid-true", 0o4755)  # a setuid file of the host's root, once the sandbox is gone
    os.symlink(where["secret"], "link-to-host")  # for the host side to follow
    attempt("reach a host server", lambda: socket.create_connection(("127.0.0.1", where["port"]), timeout=5))
    attempt("reach the network", lambda: socket.create_connection(("10.255.255.1", 80), timeout=5))
    for command in (["git", "log"], ["curl", "-s", "http://127.0.0.1:1/"], ["pip", "install", "requests"]):
        result = subprocess.run(command, capture_output=True, text=True)
        tried[command[0]] = f"exit {result.returncode}"
    tried["git history"] = "present" if os.path.exists(".git") else "absent"
    subprocess.Popen(["sh", "-c", "sleep 3600; : " + where["marker"]], start_new_session=True)  # must not outlive it
    base = os.environ["OPENAI_BASE_URL"]
    tried["proxy health"] = json.loads(urllib.request.urlopen(base.split("/e/")[0] + "/health").read())["status"]
    reply = OpenAI().chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    tried["model call"] = "answered" if reply.choices[0].message.content is not None else "empty"
    open("done.txt", "w").write("in the workspace")
    print(json.dumps({"answer": json.dumps(tried)}))
''')

TEST_SH = """#!/bin/bash
# 1 when the agent left done.txt and the tests directory is whole
if [ -f /app/done.txt ] && [ -f /tests/test.sh ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""


class _Host(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(b"reached the host\n")


@pytest.fixture
def host_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _task(root: Path, prompt: str) -> Path:
    task = root / "escape"
    (task / "tests").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "environment" / "repo" / ".git").mkdir(parents=True)
    (task / "environment" / "repo" / ".git" / "HEAD").write_text("ref: refs/heads/answer\n")
    (task / "environment" / "repo" / "notes.txt").write_text("the agent's files\n")
    (task / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\nCOPY repo/ ./\n")
    (task / "instruction.md").write_text(prompt)
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "solution" / "solve.sh").write_text("touch done.txt\n")
    return task


async def test_every_way_out_is_refused_and_the_proxy_alone_answers(upstream, host_server, tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_TEST_SECRET", "a host key")
    run_dir = tmp_path / "run"
    other = run_dir / "workspaces" / "another-episode"
    other.mkdir(parents=True)
    (other / "work.txt").write_text("another episode's work\n")
    secret = tmp_path / "host-secret.txt"
    secret.write_text("the host's\n")
    marker = f"harness-escape-{os.getpid()}"
    tasks_root = tmp_path / "tasks"
    where = {"tests": str(tasks_root / "escape" / "tests"), "solution": str(tasks_root / "escape" / "solution"),
             "db": str(run_dir / "harness.duckdb"), "other_workspace": str(other), "secret": str(secret),
             "port": host_server, "marker": marker}
    _task(tasks_root, "Try to leave. PATHS:" + json.dumps(where))
    agent = tmp_path / "escape.py"
    agent.write_text(ESCAPE)
    tasks = read_tasks(tasks_root)
    config = RunConfig(command=[sys.executable, str(agent)], judge=None, timeout_s=600,
                       blocked_commands=("git", "curl", "pip"), keep_workspaces=True)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), run_dir, progress=False)

    [(status, answer, error, sandbox)] = db_rows(run_dir / "harness.duckdb",
                                                 "SELECT status, answer, error, sandbox FROM episode_outcomes")
    assert status == "finished", error
    tried = json.loads(answer)
    refused = {k: v for k, v in tried.items() if v.startswith("refused")}
    # A write to the host file's path may land in the sandbox's private /tmp (tmp_path is under /tmp, and the
    # agent's own file is bound there): the host's file must be unchanged either way (below).
    expected_refusals = {"read tests", "list /tests", "read solution", "read the run's database",
                         "list another episode's workspace", "read a host file", "reach a host server",
                         "reach the network", "write a kernel setting", "trigger sysrq"}
    expected_refusals |= {k for k in tried if k.startswith("write ")} - {f"write {secret}"}
    assert set(refused) - {f"write {secret}"} == expected_refusals, tried
    assert tried["git"] == tried["curl"] == tried["pip"] == "exit 126", tried
    assert tried["git history"] == "absent" and tried["host secret in the environment"] == "absent"
    assert tried["proxy health"] == "ok" and tried["model call"] == "answered"

    sandbox = json.loads(sandbox)
    reasons = [(f["reason"], f.get("command") or f.get("path")) for f in sandbox["flags"]]
    assert sorted(reasons) == [("blocked_command", "curl"), ("blocked_command", "git"), ("blocked_command", "pip"),
                               ("git_history_removed", "/app/.git")], reasons
    assert report["sandbox_flags"] == {"blocked_command": 3, "git_history_removed": 1}
    assert sandbox["backend"] == "bwrap" and sandbox["workdir"] == "/app"

    # nothing outside the workspace changed
    assert secret.read_text() == "the host's\n"
    assert sorted(p.name for p in other.iterdir()) == ["work.txt"]
    assert (tasks_root / "escape" / "tests" / "test.sh").read_text() == TEST_SH
    assert not running_with(marker)

    # the model call went through the proxy and is recorded; the verifier scored the workspace
    [(calls,)] = db_rows(run_dir / "harness.duckdb", "SELECT count(*) FROM calls WHERE run_id = ? AND status = 'ok'",
                         [run_id])
    assert calls == 1
    [(judge, reward, jerror)] = db_rows(run_dir / "harness.duckdb", "SELECT judge, reward, error FROM judgements")
    assert (judge, reward, jerror) == (harbor.JUDGE, 1.0, None)
    workspace = Path(sandbox["workspace"])  # kept (keep_workspaces): what the agent left on the host
    assert (workspace / "done.txt").exists() and not (workspace / "suid-true").stat().st_mode & 0o6000
    assert (workspace / "link-to-host").is_symlink()
