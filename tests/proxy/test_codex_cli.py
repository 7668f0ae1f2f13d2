"""Codex CLI as it ships (npm @openai/codex, pinned in examples/coding_agents/package.json; `make install` puts it
in examples/coding_agents/node_modules), unmodified, pointed at the proxy by its own provider settings only
(`wire_api = "responses"`, `base_url` an episode URL). The engine is the scripted one, so the model writes the tool
calls a coding task needs: Codex runs `exec_command` twice in a scratch directory, gets the outputs back to the
model, and finishes with exit 0; every call is recorded, its hosted tool recorded as left out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.support import RunningProxy, db_rows

CODING_AGENTS = Path(__file__).resolve().parents[2] / "examples" / "coding_agents"
CODEX = CODING_AGENTS / "node_modules" / ".bin" / "codex"


def _codex_home(tmp_path: Path, base_url: str) -> Path:
    """Codex's settings for a provider at `base_url`, as a user writes them into ~/.codex/config.toml."""
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(f'''model = "gpt-5-codex"
model_provider = "harness"
check_for_update_on_startup = false

[model_providers.harness]
name = "harness proxy"
base_url = "{base_url}"
env_key = "HARNESS_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false
''')
    return home


def _exec_command(cmd: str) -> dict:
    return {"tool_name": "exec_command", "tool_arguments": json.dumps({"cmd": cmd}), "content": None}


@pytest.fixture
def codex() -> Path:
    if shutil.which("node") is None:
        pytest.skip("no node here: Codex CLI runs on Node")
    assert CODEX.exists(), "examples/coding_agents/node_modules has no codex: `make install` runs npm ci there"
    return CODEX


def test_codex_exec_runs_a_shell_tool_loop_through_the_proxy(codex, upstream, tmp_path):
    upstream.script.then = [_exec_command("echo hello > out.txt"), _exec_command("cat out.txt"),
                            {"tool_arguments": None, "content": "done: out.txt says hello", "text_finish": "stop"}]
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    try:
        home = _codex_home(tmp_path, f"{proxy.url}/e/codex-1/v1")
        done = subprocess.run([str(codex), "exec", "--skip-git-repo-check",
                               "--dangerously-bypass-approvals-and-sandbox", "--disable", "plugins",
                               "write hello into out.txt and show it"],
                              cwd=scratch, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                              env={**os.environ, "CODEX_HOME": str(home), "HARNESS_KEY": "sk-any"})
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert (scratch / "out.txt").read_text() == "hello\n"
    assert "done: out.txt says hello" in done.stdout
    requests = upstream.engine.requests
    assert len(requests) == 3 and not upstream.script.then
    offered = [t["function"]["name"] for t in requests[0]["tools"]]
    assert "exec_command" in offered and "multi_agent_v1__spawn_agent" in offered
    outputs = [m["content"] for m in requests[2]["messages"] if m["role"] == "tool"]
    assert len(outputs) == 2 and "hello" in outputs[1]  # what `cat out.txt` printed reached the model
    rows = db_rows(proxy.db_path, "SELECT call_index, status, extra FROM calls WHERE episode_id = 'codex-1' "
                   "ORDER BY call_index")
    assert [(i, s) for i, s, _ in rows] == [(0, "ok"), (1, "ok"), (2, "ok")]
    for *_, extra in rows:
        extra = orjson.loads(extra)
        assert extra["wire"] == "responses" and extra["tools_left_out"] == ["web_search"]
