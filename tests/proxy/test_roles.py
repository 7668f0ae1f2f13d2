"""Named roles: calls matched by model name, system prompt or fingerprint; frozen roles served by their own
upstream (a fixed model), recorded with their name, never with the upstream's key; rules that make no sense
refused with a message that names them.

The policy and the fixed model are two scripted engines (real HTTP servers), so the test can tell which one
answered each call; the agent is the real openai SDK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from openai import OpenAI

from proxy.roles import RoleRule, find_role, parse_assignments, parse_rules
from proxy.scripted_engine import Script
from tests.support import RunningProxy, ScriptedUpstream, db_rows

SOLVER = "You solve math word problems."
CRITIC = "You review a proposed answer."


def _say(client: OpenAI, model: str, system: str, text: str) -> str:
    reply = client.chat.completions.create(model=model, max_tokens=8, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": text}])
    return reply.choices[0].message.content


def test_a_frozen_role_is_served_by_its_own_upstream_and_recorded_by_name(upstream, tmp_path, monkeypatch):
    fixed = ScriptedUpstream(Script(content="LOOKS RIGHT", model="fixed-critic"))
    monkeypatch.setenv("CRITIC_KEY", "sk-critic-secret-123")
    rules = parse_rules({"solver": "model:gpt-4o-mini", "critic": f"system:^{CRITIC[:12]}"},
                        {"critic": fixed.url + "/v1"}, {"critic": "gpt-4o"}, {"critic": "CRITIC_KEY"})
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=rules)
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep1/v1", api_key="sk-agent", max_retries=0)
        _say(client, "gpt-4o-mini", SOLVER, "2 + 2?")
        assert _say(client, "critic-model", CRITIC, "Problem: 2 + 2. Answer: 4") == "LOOKS RIGHT"
        _say(client, "gpt-4o-mini", SOLVER, "Revise.")
        _say(client, "other-model", "You chat.", "hi")  # no rule matches: the policy serves it, unnamed
    finally:
        proxy.close()
        fixed.close()
    # The policy engine saw the solver's two calls and the unnamed one; the fixed model only the critic's, under
    # the model name the rule gives, with the agent's own sampling and no vLLM-only fields, and with its key.
    assert len(upstream.engine.requests) == 3
    [critic_request] = fixed.engine.requests
    assert critic_request["model"] == "gpt-4o" and "return_token_ids" not in critic_request
    assert "logprobs" not in critic_request  # not asked by the agent: reasoning models refuse it
    assert fixed.engine.authorizations == ["Bearer sk-critic-secret-123"]
    rows = db_rows(proxy.db_path, "SELECT call_index, extra->>'role', extra->>'upstream', requested_model, status "
                   "FROM calls ORDER BY call_index")
    assert rows == [(0, "solver", None, "gpt-4o-mini", "ok"), (1, "critic", fixed.url + "/v1", "critic-model", "ok"),
                    (2, "solver", None, "gpt-4o-mini", "ok"), (3, None, None, "other-model", "ok")]
    assert b"sk-critic-secret-123" not in (tmp_path / "rec.duckdb").read_bytes()
    # `harness roles` names the roles and says what served each.
    out = subprocess.run([sys.executable, "-m", "harness.cli", "roles", "--db", str(proxy.db_path), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    roles = {r["role"]: r for r in json.loads(out.stdout)}
    assert set(roles) == {"solver", "critic", None}
    assert roles["solver"]["calls"] == 2 and roles["solver"]["served_by"] == "policy"
    assert roles["critic"]["served_by"] == fixed.url + "/v1"


def test_matching_by_fingerprint_and_first_match_wins():
    body = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "You review things"}]}]}
    rules = parse_rules({"by-key": "key:abc123", "by-system": "system:review", "by-model": "model:m"})
    assert find_role(rules, "m", body, "abc123").name == "by-key"
    assert find_role(rules, "m", body, "zzz").name == "by-system"
    assert find_role(rules, "m", {"messages": []}, "zzz").name == "by-model"
    assert find_role(rules, "x", {"messages": []}, "zzz") is None
    assert find_role((), "m", body, "abc123") is None
    odd = {"messages": [{"role": "system", "content": [{"type": "text", "text": 5}, "x", {"text": "review me"}]}]}
    assert find_role(rules, "x", odd, "zzz").name == "by-system"  # malformed parts are skipped, never a crash


@pytest.mark.parametrize("make,message", [
    (lambda: RoleRule("critic", "model"), "must be model:NAME, system:REGEX or key:FINGERPRINT"),
    (lambda: RoleRule("critic", "system:(unclosed"), "does not compile"),
    (lambda: RoleRule("bad name", "model:m"), "role name 'bad name'"),
    (lambda: RoleRule("critic", "model:m", upstream="ftp://x"), "must start with http"),
    (lambda: parse_rules({"solver": "model:m"}, {"critic": "http://x"}), "role 'critic' has an upstream but no match"),
    (lambda: parse_assignments(["critic"], "--role"), "--role 'critic' must look like NAME=VALUE"),
    (lambda: RoleRule("planner", "model:m", policy="planner v2"), "role 'planner': policy name 'planner v2'"),
    (lambda: RoleRule("planner", "model:m", policy=""), "role 'planner': policy name ''"),
    (lambda: RoleRule("critic", "model:m", upstream="http://x", policy="critic"),
     "role 'critic' has an upstream .* and a policy .*: a frozen role"),
    (lambda: parse_rules({"solver": "model:m"}, policies={"planner": "planner"}),
     "role 'planner' has a policy but no match"),
])
def test_bad_role_rules_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_harness_run_flags_refuse_an_upstream_without_a_role(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"id": "t", "question": "q"}\n')
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--cmd", "true", "--data",
                          str(tmp_path / "tasks.jsonl"), "--upstream", "http://127.0.0.1:9",
                          "--role-upstream", "critic=http://127.0.0.1:9/v1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "role 'critic' has an upstream but no match" in out.stderr


def test_agents_never_see_a_frozen_roles_upstream_key(upstream, tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"id": "t", "question": "q"}\n')
    agent = "import json, os; print(json.dumps({'answer': os.environ.get('CRITIC_KEY', 'absent')}))"
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--cmd", f'{sys.executable} -c "{agent}"',
                          "--data", str(tmp_path / "tasks.jsonl"), "--upstream", upstream.url, "--run-dir",
                          str(tmp_path / "run"), "--role", "critic=model:critic-model", "--role-upstream",
                          "critic=http://127.0.0.1:9/v1", "--role-key-env", "critic=CRITIC_KEY"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CRITIC_KEY": "sk-critic-secret-456"})
    assert out.returncode == 0, out.stderr
    assert db_rows(tmp_path / "run" / "harness.duckdb", "SELECT answer FROM episode_outcomes") == [("absent",)]
