"""One policy per trained role: each role's calls go to the engine under its policy's current model name (one LoRA
adapter per role, named by the trainer through POST /harness/weights with "policy"), and every call records its
role and the policy that served it; bad admin input is a 400 naming the key.

The policy engine and a frozen role's fixed model are scripted engines (real HTTP servers); the scripted engine
serves a loaded LoRA adapter under its name, as vLLM does, so `calls.served_model` shows which adapter answered.
The agent is the real openai SDK, the database the real DuckDB file.
"""

from __future__ import annotations

import re

import pytest
import requests
from openai import OpenAI

from harness.store.database import Store
from proxy.config import ProxyConfig
from proxy.roles import parse_rules
from proxy.scripted_engine import Script
from tests.support import RunningProxy, ScriptedUpstream, db_rows

PLANNER = "You plan the steps of a task."
EXECUTOR = "You execute one step of a plan."
RULES = {"planner": "model:gpt-4o-mini", "executor": "system:^You execute", "critic": "model:critic-model"}
POLICIES = {"planner": "planner", "executor": "executor"}


def _say(client: OpenAI, model: str, system: str, text: str) -> None:
    client.chat.completions.create(model=model, max_tokens=8, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": text}])


def _round(client: OpenAI) -> None:
    """One call of each role: the planner, the executor (any model name), an unnamed agent, the frozen critic."""
    _say(client, "gpt-4o-mini", PLANNER, "Plan: sum 2 and 2.")
    _say(client, "executor-model", EXECUTOR, "Step 1: add.")
    _say(client, "other-model", "You chat.", "hi")
    _say(client, "critic-model", "You review.", "Is 4 right?")


def _admin(proxy: RunningProxy, method: str, route: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{proxy.url}/harness/{route}", json=body, headers=proxy.admin_headers,
                            timeout=10)


def test_each_roles_calls_go_to_its_policys_adapter_and_record_role_and_policy(upstream, tmp_path):
    fixed = ScriptedUpstream(Script(content="LOOKS RIGHT", model="fixed-critic"))
    rules = parse_rules(RULES, {"critic": fixed.url + "/v1"}, policies=POLICIES)
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=rules)
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep1/v1", api_key="sk-agent", max_retries=0)
        _round(client)  # no policy has a name of its own yet: every policy's calls go to the default one's
        # The trainer's step 1: each policy's adapter loaded under a versioned name, then the proxy told.
        for policy in ("planner", "executor", "policy"):
            loaded = requests.post(upstream.url + "/v1/load_lora_adapter",
                                   json={"lora_name": f"{policy}-v000001", "lora_path": "/adapters"}, timeout=10)
            assert loaded.status_code == 200
            answer = _admin(proxy, "POST", "weights", {"version": 1, "policy": policy, "model": f"{policy}-v000001"})
            assert answer.status_code == 200, answer.text
        assert answer.json() == {"weight_version": 1, "served_model": "policy-v000001", "policy_models": {
            "policy": "policy-v000001", "planner": "planner-v000001", "executor": "executor-v000001"}}
        status = _admin(proxy, "GET", "status").json()
        assert status["policy_models"] == answer.json()["policy_models"] and status["weight_version"] == 1
        _round(client)
    finally:
        proxy.close()
        fixed.close()
    # The policy engine got the three policy calls of each round, under the default name, then each policy's own;
    # the frozen critic's calls went to their fixed model alone.
    assert [r["model"] for r in upstream.engine.requests] == [
        "scripted-model", "scripted-model", "scripted-model", "planner-v000001", "executor-v000001", "policy-v000001"]
    assert len(fixed.engine.requests) == 2
    rows = db_rows(proxy.db_path, "SELECT call_index, role, policy, served_model, extra->>'role', weight_version "
                   "FROM calls ORDER BY call_index")
    assert rows == [
        (0, "planner", "planner", "scripted-model", "planner", 0),
        (1, "executor", "executor", "scripted-model", "executor", 0),
        (2, None, "policy", "scripted-model", None, 0),
        (3, "critic", None, "fixed-critic", "critic", 0),
        (4, "planner", "planner", "planner-v000001", "planner", 1),
        (5, "executor", "executor", "executor-v000001", "executor", 1),
        (6, None, "policy", "policy-v000001", None, 1),
        (7, "critic", None, "fixed-critic", "critic", 1),
    ]
    roles = db_rows(proxy.db_path, "SELECT role, policy, served_by, calls FROM roles ORDER BY role NULLS LAST")
    assert roles == [("critic", None, fixed.url + "/v1", 2), ("executor", "executor", "policy", 2),
                     ("planner", "planner", "policy", 2), (None, "policy", "policy", 2)]
    with Store.open(proxy.db_path, read_only=True) as store:  # the records a trainer reads carry them too
        assert [(c.role, c.policy) for c in store.load_calls("ep1")][:4] == [
            ("planner", "planner"), ("executor", "executor"), (None, "policy"), ("critic", None)]


def test_a_policy_without_a_name_of_its_own_follows_the_default_one(upstream, tmp_path):
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=parse_rules(RULES, policies=POLICIES))
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep1/v1", api_key="sk-agent", max_retries=0)
        assert _admin(proxy, "POST", "weights", {"version": 2, "policy": "planner", "model": "planner-v2"}).ok
        assert _admin(proxy, "POST", "weights", {"version": 2, "model": "base-v2"}).ok  # no "policy": the default
        _say(client, "gpt-4o-mini", PLANNER, "Plan.")
        _say(client, "executor-model", EXECUTOR, "Do.")
        assert _admin(proxy, "GET", "status").json()["policy_models"] == {
            "policy": "base-v2", "planner": "planner-v2", "executor": "base-v2"}
    finally:
        proxy.close()
    assert [r["model"] for r in upstream.engine.requests] == ["planner-v2", "base-v2"]
    assert db_rows(proxy.db_path, "SELECT role, policy FROM calls ORDER BY call_index") == [
        ("planner", "planner"), ("executor", "executor")]


def test_each_call_is_stamped_with_its_own_policys_version_between_two_pushes(upstream, tmp_path):
    """A step pushes its policies one after another: between the planner's push and the executor's, a planner call
    is sampled by the new planner adapter and an executor call by the old executor one, and each says so."""
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=parse_rules(RULES, policies=POLICIES))
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep1/v1", api_key="sk-agent", max_retries=0)
        for policy in ("planner", "executor"):
            assert _admin(proxy, "POST", "weights", {"version": 4, "policy": policy, "model": f"{policy}-v4"}).ok
        assert _admin(proxy, "POST", "weights", {"version": 5, "policy": "planner", "model": "planner-v5"}).ok
        _say(client, "gpt-4o-mini", PLANNER, "Plan.")  # the executor's push of version 5 has not come yet
        _say(client, "executor-model", EXECUTOR, "Do.")
        _say(client, "other-model", "You chat.", "hi")  # the default policy: never pushed, the base at version 0
    finally:
        proxy.close()
    assert [r["model"] for r in upstream.engine.requests] == ["planner-v5", "executor-v4", "scripted-model"]
    assert db_rows(proxy.db_path, "SELECT policy, weight_version FROM calls ORDER BY call_index") == [
        ("planner", 5), ("executor", 4), ("policy", 0)]


BAD = [  # (body, the key the error names, what its message says)
    ({"version": 1, "policy": "planner"}, "model", "'model' is required with 'policy'"),
    ({"version": 1, "policy": "planner v2", "model": "m"}, "policy", "'policy' must be a policy name"),
    ({"version": 1, "policy": 7, "model": "m"}, "policy", "got 7"),
    ({"version": 1, "policy": "", "model": "m"}, "policy", "'policy' must be a policy name"),
    ({"version": 1, "policy": "planer", "model": "m"}, "policy",
     "'planer' serves no role of this proxy, whose policies are 'policy', 'planner', 'executor'"),
]


def test_bad_per_policy_weights_are_a_400_naming_the_key_and_change_nothing(upstream, tmp_path):
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=parse_rules(RULES, policies=POLICIES))
    try:
        answers = [_admin(proxy, "POST", "weights", body) for body, _, _ in BAD]
        status = _admin(proxy, "GET", "status").json()
    finally:
        proxy.close()
    for answer, (body, param, message) in zip(answers, BAD, strict=True):
        assert answer.status_code == 400, body
        error = answer.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
        assert message in error["message"], (body, error)
    assert status["weight_version"] == 0 and status["policy_models"] == {
        "policy": "scripted-model", "planner": "scripted-model", "executor": "scripted-model"}


def test_policy_models_given_at_start_serve_each_policy_from_the_first_call(upstream, tmp_path):
    """`harness run --trained`: the engine starts with the run's adapters loaded, and the proxy is told at start
    which policy each one is (ProxyConfig.policy_models), so no call goes to the base first."""
    for name in ("planner-lora-run", "policy-lora-run"):
        assert requests.post(upstream.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/a"},
                             timeout=10).status_code == 200
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=parse_rules(RULES, policies=POLICIES),
                         policy_models={"planner": "planner-lora-run", "policy": "policy-lora-run"})
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep1/v1", api_key="sk-agent", max_retries=0)
        _say(client, "gpt-4o-mini", PLANNER, "Plan.")
        _say(client, "executor-model", EXECUTOR, "Do.")  # no adapter of its own: served as the default policy
        _say(client, "other-model", "You chat.", "hi")
        status = _admin(proxy, "GET", "status").json()
    finally:
        proxy.close()
    assert status["served_model"] == "policy-lora-run" and status["policy_models"] == {
        "policy": "policy-lora-run", "planner": "planner-lora-run", "executor": "policy-lora-run"}
    assert [r["model"] for r in upstream.engine.requests] == ["planner-lora-run", "policy-lora-run", "policy-lora-run"]
    assert db_rows(proxy.db_path, "SELECT role, policy, served_model FROM calls ORDER BY call_index") == [
        ("planner", "planner", "planner-lora-run"), ("executor", "executor", "policy-lora-run"),
        (None, "policy", "policy-lora-run")]


def test_policy_models_naming_a_policy_no_role_has_is_refused(upstream, tmp_path):
    rules = parse_rules(RULES, policies=POLICIES)
    for models, message in (({"planer": "x"}, "names policy 'planer', which serves no role of this proxy"),
                            ({"planner": ""}, "policy_models['planner'] '' must be the engine's model name")):
        with pytest.raises(ValueError, match=re.escape(message)):
            ProxyConfig(upstream_url=upstream.url, db_path=tmp_path / "x.duckdb", roles=rules, policy_models=models)
