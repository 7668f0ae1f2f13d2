"""Coding agents as they ship (npm packages pinned in examples/coding_agents/package.json; `make install` puts them
in examples/coding_agents/node_modules), unmodified, pointed at the proxy by their own settings only: Codex CLI by a
provider with `wire_api = "responses"` and `base_url` an episode URL, Claude Code by ANTHROPIC_BASE_URL. The engine
is the scripted one, so the model writes the tool calls a coding task needs: each agent runs its shell tool twice
in a scratch directory, gets the outputs back to the model, and finishes with exit 0; every call is recorded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.support import RunningProxy, db_rows

CODING_AGENTS = Path(__file__).resolve().parents[2] / "examples" / "coding_agents"
BIN = CODING_AGENTS / "node_modules" / ".bin"


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
    upstream.script.then = [_exec_command("echo hello > out.txt"), _exec_command("cat out.txt"),
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
    upstream.script.then = [_bash("echo hello > out.txt"), _bash("cat out.txt"),
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
    rows = _episode(proxy, "claude-1")
    assert [(i, s) for i, s, _ in rows] == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert all(orjson.loads(extra)["wire"] == "messages" for *_, extra in rows)


# ---------------------------------------------------------------------------------------------- harness run, train

TASKS = CODING_AGENTS / "tasks.jsonl"
TERSE_YAML = Path(__file__).resolve().parents[2] / "examples" / "train" / "terse.yaml"
# What the scripted model does for each task, in the file's order: two shell commands, then a closing word. The last
# task's edit is wrong on purpose, so its check fails and its judgement is 0.
SOLUTIONS = {"hello-file": ["echo hello > out.txt", "cat out.txt"],
             "fix-greeting": ["sed -i s/helo/hello/ greet.py", "python3 greet.py"],
             "count-lines": ["wc -l < data.txt > count.txt", "cat count.txt"],
             "add-function": ["printf 'def add(a, b):\\n    return a - b\\n' >> calc.py", "cat calc.py"]}


@pytest.mark.parametrize("agent", ["codex", "claude"])
def test_harness_run_scores_a_coding_agent_on_tasks_and_trains_on_the_run(agent, upstream, tiny_model_dir,
                                                                           tmp_path):
    """`harness run` with the CLI as the agent over the four tasks of examples/coding_agents (each in its own
    scratch git repository, the task's check run there), judged; then one `--from-run` update on the passing
    episodes. One episode at a time, so the scripted model's calls follow the tasks' order."""
    _installed(agent)
    step = _exec_command if agent == "codex" else _bash
    probe = {"tool_arguments": None, "content": None}  # harness run's first chat call: it probes the engine
    upstream.script.then = [probe, *(s for commands in SOLUTIONS.values() for s in (
        *(step(c) for c in commands), {"tool_arguments": None, "content": "done", "text_finish": "stop"}))]
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--cmd",
                           f"{sys.executable} {CODING_AGENTS / 'coding_agent.py'} {agent}", "--data", str(TASKS),
                           "--judge", "exact_match", "--upstream", upstream.url, "--concurrency", "1",
                           "--timeout", "120", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not upstream.script.then and len(upstream.engine.requests) == 1 + 12
    db = run_dir / "harness.duckdb"
    rewards = dict(db_rows(db, "SELECT e.task_id, j.reward FROM episode_outcomes e JOIN judgements j USING "
                           "(episode_id)"))
    assert rewards == {"hello-file": 1.0, "fix-greeting": 1.0, "count-lines": 1.0, "add-function": 0.0}
    calls = db_rows(db, "SELECT e.task_id, count(*), bool_and(c.status = 'ok'), any_value(c.extra->>'wire') FROM "
                    "calls c JOIN episode_outcomes e USING (episode_id) GROUP BY 1")
    wire = "responses" if agent == "codex" else "messages"
    assert sorted(calls) == sorted((task, 3, True, wire) for task in SOLUTIONS)
    (run_id,), = db_rows(db, "SELECT DISTINCT run_id FROM episode_outcomes")
    trained = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(TERSE_YAML),
                              f"--set=model.path={tiny_model_dir}", f"--set=logging.run_dir={tmp_path / 'train'}",
                              "--set=experiment_name=coding", "--set=logging.console=false",
                              "--set=logging.curve_png=false", f"--from-run={run_id}", f"--db={db}",
                              "--where=reward >= 1", "--set=offline.batch_size=3"],
                             capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    episodes = db_rows(tmp_path / "train" / "coding" / "harness.duckdb",
                       "SELECT value FROM metrics WHERE name = 'offline/episodes'")
    assert episodes == [(3.0,)]  # the three passing episodes, the failing one left out
