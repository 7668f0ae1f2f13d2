"""The `harness` command as a user runs it: `serve --upstream` in a subprocess, `sql` against it live and closed,
and an upstream that knows nothing of token ids recorded as text only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from harness.running.vllm_server import attach
from harness.store.live import info_path
from tests.support import RunningProxy, db_rows

HARNESS = [sys.executable, "-m", "harness.cli"]


def _wait_for_info(db, process, timeout_s=30.0) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"harness serve exited early: {process.stderr.read()}")
        try:
            return json.loads(info_path(db).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.1)
    raise AssertionError("harness serve did not announce itself")


@pytest.mark.parametrize("token_ids", [True, False])
def test_serve_attached_records_and_sql_works_live_and_closed(upstream, tmp_path, token_ids):
    upstream.script.token_ids = token_ids
    db = tmp_path / "rec.duckdb"
    serve = subprocess.Popen(HARNESS + ["serve", "--upstream", upstream.url + "/v1", "--port", "0", "--db", str(db),
                                        "--run-dir", str(tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        info = _wait_for_info(db, serve)
        assert oct(os.stat(info_path(db)).st_mode & 0o777) == "0o600"  # it holds the admin token
        client = openai.OpenAI(base_url=info["url"] + "/e/cli-ep/v1", api_key="sk-x", max_retries=0)
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        live = subprocess.run(HARNESS + ["sql", "--db", str(db), "--csv",
                                         "SELECT episode_id, token_source FROM calls"],
                              capture_output=True, text=True, timeout=60)
        assert live.returncode == 0, live.stderr
        assert live.stdout.splitlines() == ["episode_id,token_source", f"cli-ep,{'engine' if token_ids else 'none'}"]
    finally:
        serve.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err
    assert ("returns no token ids" in err) == (not token_ids)
    assert not info_path(db).exists()
    table = subprocess.run(HARNESS + ["sql", "--db", str(db), "SELECT count(*) AS calls FROM calls"],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "calls" in table.stdout and "1" in table.stdout


def test_record_only_forwards_calls_as_sent_with_the_agent_s_key_and_stores_no_key(upstream, tmp_path):
    """`harness serve --upstream URL --record-only` in front of a hosted-style API (no token ids): the model name,
    sampling and API key go upstream as the agent sent them, nothing is added, and the key is nowhere on disk;
    with --upstream-key-env, a call that carries no key of its own (or the proxy's token) gets that key sent."""
    upstream.script.token_ids = False
    db, secret = tmp_path / "rec.duckdb", "sk-live-Secret-4242"
    azure_query = "api-version=2024-10-21&key=sk-query-55"  # a key in the query goes upstream, and nowhere else
    serve = subprocess.Popen(HARNESS + ["serve", "--upstream", upstream.url + "/v1", "--record-only", "--port", "0",
                                        "--db", str(db), "--run-dir", str(tmp_path), "--upstream-key-env",
                                        "HOSTED_KEY"],
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "HOSTED_KEY": "sk-env-777"})
    try:
        info = _wait_for_info(db, serve)
        client = openai.OpenAI(base_url=info["url"] + "/e/prod-1/v1", api_key=secret, max_retries=0,
                               organization="org-7")
        messages = [{"role": "user", "content": "hi"}]
        assert [m.id for m in client.models.list()] == ["scripted-model"]  # /v1/models: forwarded with the key
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, temperature=0.3)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, stream=True) if chunk.choices)
        keyless = urllib.request.Request(info["url"] + "/v1/chat/completions", method="POST",
                                         data=json.dumps({"model": "qwen-plus", "messages": messages}).encode(),
                                         headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(keyless, timeout=30) as answer:
            assert answer.status == 200
        azure = urllib.request.Request(  # Azure OpenAI's way: the key in `api-key`, the API version in the query
            info["url"] + f"/e/prod-1/v1/chat/completions?{azure_query}", method="POST",
            data=json.dumps({"model": "gpt-4o", "messages": messages}).encode(),
            headers={"Content-Type": "application/json", "api-key": secret})
        with opener.open(azure, timeout=30) as answer:
            assert answer.status == 200
    finally:
        serve.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err
    assert upstream.engine.authorizations == [f"Bearer {secret}", f"Bearer {secret}", "Bearer sk-env-777", None]
    assert upstream.engine.headers[3].get("api-key") == secret
    assert upstream.engine.targets[-1] == f"/v1/chat/completions?{azure_query}"
    assert [(h.get("Authorization"), h.get("OpenAI-Organization")) for h in upstream.engine.models_headers] == \
        [(f"Bearer {secret}", "org-7")]
    assert upstream.engine.headers[0].get("OpenAI-Organization") == "org-7"
    first = upstream.engine.requests[0]
    assert first == {"model": "gpt-4o-mini", "messages": messages, "temperature": 0.3}  # as sent: nothing added
    assert [r["model"] for r in upstream.engine.requests] == ["gpt-4o-mini", "gpt-4o-mini", "qwen-plus", "gpt-4o"]
    assert not any(k.lower().startswith("x-harness") for h in upstream.engine.headers for k in h)
    rows = db_rows(db, "SELECT c.episode_id, c.requested_model, c.token_source, ch.text FROM calls c "
                   "JOIN choices ch USING (call_id) ORDER BY c.started_at")
    assert [r[:3] for r in rows[:2]] == [("prod-1", "gpt-4o-mini", "none")] * 2
    assert [r[3] for r in rows] == [reply.choices[0].message.content, streamed, *(r[3] for r in rows[2:])]
    assert streamed and len(rows) == 4
    for path in tmp_path.rglob("*"):  # the keys are in no file: not the database, not a log
        if path.is_file():
            assert not any(k in path.read_bytes() for k in (secret.encode(), b"sk-env-777", b"sk-query-55")), path
    assert not any(k in err for k in (secret, "sk-env-777", "sk-query-55"))  # nor in what it logged
    for flags, says in ((["--temperature", "0"], "--temperature"), (["--auth-token", "t"], "--upstream-key-env")):
        wrong = subprocess.run(HARNESS + ["serve", "--upstream", upstream.url, "--record-only", *flags],
                               capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 2 and says in wrong.stderr, wrong.stderr


@pytest.mark.parametrize("probed", [True, False])
def test_upstream_without_token_ids_is_recorded_as_text(upstream, tmp_path, caplog, probed):
    upstream.script.token_ids = False
    engine = attach(upstream.url)
    assert engine.returns_token_ids is False
    # probed: the proxy knows and does not ask; not probed: it asks, gets nothing, and says so once
    returns_token_ids = engine.returns_token_ids if probed else True
    proxy = RunningProxy(upstream.url, tmp_path / "text.duckdb", returns_token_ids=returns_token_ids)
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        for _ in range(2):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    finally:
        proxy.close()
    assert ("return_token_ids" in upstream.engine.requests[-1]) == (not probed)
    rows = db_rows(proxy.db_path, "SELECT token_source, prompt_ids, completion_ids, text FROM calls JOIN choices "
                   "USING (call_id)")
    assert len(rows) == 2
    source, prompt_ids, completion_ids, text = rows[0]
    assert (source, prompt_ids, completion_ids) == ("none", None, None)
    assert text.startswith("w1000")
    warnings = [r for r in caplog.records if "returned no token ids" in r.getMessage()]
    assert len(warnings) == (0 if probed else 1)


def test_sql_errors_are_clear(tmp_path):
    missing = subprocess.run(HARNESS + ["sql", "--db", str(tmp_path / "nope.duckdb"), "SELECT 1"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no database at" in missing.stderr
    parser = subprocess.run(HARNESS + ["serve", "--model", str(tmp_path), "--tool-parser", "qwen2.5"],
                            capture_output=True, text=True, timeout=60)
    assert parser.returncode == 2 and "unknown tool parser 'qwen2.5'" in parser.stderr and "hermes" in parser.stderr
    bad = subprocess.run(HARNESS + ["serve", "--model", str(tmp_path / "no-such-model")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "is not a directory" in bad.stderr


def test_help_answers():
    for verb in ([], ["serve"], ["run"], ["judge"], ["merge"], ["sql"], ["roles"], ["tiny-model"], ["doctor"],
                 ["parsers"], ["train"], ["sft"], ["view"], ["export"], ["retokenize"]):
        out = subprocess.run(HARNESS + verb + ["--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage: harness" in out.stdout


@pytest.mark.parametrize("flags, recorded", [([], {"mode": "chat", "reason": "no_earlier_call"}),
                                             (["--no-token-exact"], None)], ids=["default", "off"])
def test_serve_says_how_each_chat_call_was_served_unless_token_exact_is_off(upstream, tmp_path, flags, recorded):
    db = tmp_path / "rec.duckdb"
    serve = subprocess.Popen(HARNESS + ["serve", "--upstream", upstream.url, "--port", "0", "--db", str(db),
                                        "--run-dir", str(tmp_path), *flags], stderr=subprocess.PIPE, text=True)
    try:
        info = _wait_for_info(db, serve)
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="sk-x", max_retries=0)
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    finally:
        serve.send_signal(signal.SIGINT)
        serve.communicate(timeout=30)
    [(extra,)] = db_rows(db, "SELECT extra->'continuity' FROM calls")
    assert (json.loads(extra) if extra else None) == recorded


def test_roles_lists_each_role_with_its_counts_and_an_example(upstream, tmp_path):
    db = tmp_path / "rec.duckdb"
    proxy = RunningProxy(upstream.url, db)
    try:
        for episode in ("e1", "e2"):
            client = openai.OpenAI(base_url=f"{proxy.url}/e/{episode}/v1", api_key="sk-x", max_retries=0)
            for model, system in (("solver", "You solve."), ("critic", "You criticise."), ("solver", "You solve.")):
                client.chat.completions.create(model=model, messages=[{"role": "system", "content": system},
                                                                      {"role": "user", "content": "2+2?"}])
        run_id = proxy.server.run_id
    finally:
        proxy.close()
    out = subprocess.run(HARNESS + ["roles", "--db", str(db), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    roles = json.loads(out.stdout)
    assert [(r["requested_model"], r["calls"], r["episodes"], r["first_message"]) for r in roles] == [
        ("solver", 4, 2, "You solve."), ("critic", 2, 2, "You criticise.")]
    example = db_rows(db, "SELECT requested_model FROM calls WHERE call_id = ?", [roles[1]["example_call_id"]])
    assert example == [("critic",)]
    only = subprocess.run(HARNESS + ["roles", "--db", str(db), "--run", run_id], capture_output=True, text=True,
                          timeout=60)
    assert only.returncode == 0 and "solver" in only.stdout and "critic" in only.stdout
    missing = subprocess.run(HARNESS + ["roles", "--db", str(db), "--run", "nope"], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "no calls of run 'nope'" in missing.stderr and run_id in missing.stderr
