"""Coding agents as they ship (npm packages pinned in examples/coding_agents/package.json; `make install` puts them
in examples/coding_agents/node_modules), unmodified, pointed at the proxy by their own settings only: Codex CLI by a
provider with `wire_api = "responses"` and `base_url` an episode URL, Claude Code by ANTHROPIC_BASE_URL. The engine
is the scripted one, so the model writes the tool calls a coding task needs: each agent runs its shell tool twice
in a scratch directory, gets the outputs back to the model, and finishes with exit 0; every call is recorded."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.support import RunningProxy, db_rows

CODING_AGENTS = Path(__file__).resolve().parents[2] / "examples" / "coding_agents"
BIN = CODING_AGENTS / "node_modules" / ".bin"


def _coding_agent():
    """examples/coding_agents/coding_agent.py as a module: the settings it gives each CLI are the ones tested here."""
    spec = importlib.util.spec_from_file_location("coding_agent", CODING_AGENTS / "coding_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _codex_home(tmp_path: Path, base_url: str) -> Path:
    """Codex's settings for a provider at `base_url`, as a user writes them into ~/.codex/config.toml."""
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(_coding_agent().codex_config(base_url, "HARNESS_KEY"))
    return home


def _exec_command(cmd: str) -> dict:
    return {"tool_name": "exec_command", "tool_arguments": json.dumps({"cmd": cmd}), "content": None}


def _installed(name: str) -> Path:
    if shutil.which("node") is None:
        pytest.skip("no node here: the coding agents' npm packages run on Node")
    assert (BIN / name).exists(), f"examples/coding_agents/node_modules has no {name}: `make install` runs npm ci there"
    return BIN / name


@pytest.fixture
def proxy(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    yield p
    p.close()  # again, after _episode: closing twice is a no-op


def _episode(proxy: RunningProxy, episode: str) -> list[tuple]:
    """The episode's calls, from the database the proxy wrote (closed first)."""
    proxy.close()
    return db_rows(proxy.db_path, "SELECT call_index, status, extra FROM calls WHERE episode_id = ? ORDER BY "
                   "call_index", [episode])


def test_codex_exec_runs_a_shell_tool_loop_through_the_proxy(upstream, proxy, tmp_path):
    codex = _installed("codex")
    upstream.script.then = [{**_exec_command("echo hello > out.txt"), "reasoning": "Write the file first."},
                            {**_exec_command("cat out.txt"), "reasoning": None},
                            {"tool_arguments": None, "content": "done: out.txt says hello", "text_finish": "stop"}]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    home = _codex_home(tmp_path, f"{proxy.url}/e/codex-1/v1")
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check",
                           "--dangerously-bypass-approvals-and-sandbox", "--disable", "plugins",
                           "write hello into out.txt and show it"],
                          cwd=scratch, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                          env={**os.environ, "CODEX_HOME": str(home), "HARNESS_KEY": "sk-any"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (scratch / "out.txt").read_text() == "hello\n"
    assert "done: out.txt says hello" in done.stdout
    requests = upstream.engine.requests
    assert len(requests) == 3 and not upstream.script.then
    offered = [t["function"]["name"] for t in requests[0]["tools"]]
    assert "exec_command" in offered and "multi_agent_v1__spawn_agent" in offered
    outputs = [m["content"] for m in requests[2]["messages"] if m["role"] == "tool"]
    assert len(outputs) == 2 and "hello" in outputs[1]  # what `cat out.txt` printed reached the model
    # the reasoning item it got (include: reasoning.encrypted_content asked for) came back with the call it preceded
    first = next(m for m in requests[1]["messages"] if m["role"] == "assistant")
    assert first.get("reasoning") == "Write the file first." and first["tool_calls"]
    rows = _episode(proxy, "codex-1")
    assert [(i, s) for i, s, _ in rows] == [(0, "ok"), (1, "ok"), (2, "ok")]
    for *_, extra in rows:
        extra = orjson.loads(extra)
        assert extra["wire"] == "responses" and extra["tools_left_out"] == ["web_search"]


def _bash(command: str) -> dict:
    return {"tool_name": "Bash", "tool_arguments": json.dumps({"command": command, "description": "Run it"}),
            "content": None}


def test_claude_code_runs_a_bash_tool_loop_through_the_proxy(upstream, proxy, tmp_path):
    """Claude Code 2.1.332 (`claude -p`), streamed Anthropic Messages with a system message among the messages each
    turn, tool_use and tool_result blocks, thinking and cache_control settings, max_tokens 128000."""
    claude = _installed("claude")
    upstream.script.then = [{**_bash("echo hello > out.txt"), "reasoning": "Write the file first."},
                            {**_bash("cat out.txt"), "reasoning": None},
                            {"tool_arguments": None, "content": "done: out.txt says hello", "text_finish": "stop"}]
    scratch, home = tmp_path / "scratch", tmp_path / "home"
    scratch.mkdir()
    home.mkdir()
    # IS_SANDBOX: this test runs as root, where Claude Code otherwise refuses to skip its permission prompts
    done = subprocess.run([str(claude), "-p", "write hello into out.txt and show it",
                           "--dangerously-skip-permissions"], cwd=scratch, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL,
                          env={**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": f"{proxy.url}/e/claude-1",
                               "ANTHROPIC_API_KEY": "sk-ant-any", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                               "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1"})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert (scratch / "out.txt").read_text() == "hello\n"
    assert "done: out.txt says hello" in done.stdout
    requests = upstream.engine.requests
    assert len(requests) == 3 and not upstream.script.then and requests[0]["stream"] is True
    assert "Bash" in [t["function"]["name"] for t in requests[0]["tools"]]
    roles = [m["role"] for m in requests[2]["messages"]]
    assert roles.count("system") >= 2 and roles[-4:] == ["assistant", "tool", "assistant", "tool"]
    assert requests[2]["messages"][-1]["content"] == "hello"  # what `cat out.txt` printed reached the model
    # the thinking block it got came back with the tool_use it preceded
    first = next(m for m in requests[1]["messages"] if m["role"] == "assistant")
    assert first.get("reasoning") == "Write the file first." and first["tool_calls"]
    rows = _episode(proxy, "claude-1")
    assert [(i, s) for i, s, _ in rows] == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert all(orjson.loads(extra)["wire"] == "messages" for *_, extra in rows)
