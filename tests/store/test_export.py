"""`harness export --run`: recorded episodes as SFT chat records and RL token records (harness/store/export.py).

Runs are recorded for real: `harness run` of the unmodified terse agent through the proxy in front of the scripted
engine, answering like a hosted API (no token ids) or like vLLM (ids and logprobs).
The tests on the real engine are in test_export_engine.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import torch

from harness.store.export import ExportError, conversations, write
from proxy.scripted_engine import Script
from tests.support import TERSE, ScriptedUpstream, db_rows
from trainer.maths.algorithms import outcome_advantages

JUDGE = '''
import random


def spread(task, answer, calls):
    """Rewards that differ within a task's group (the scripted engine answers every call alike)."""
    return random.random()
'''


def _record(tmp_path: Path, token_ids: bool) -> tuple[Path, str]:
    upstream = ScriptedUpstream(Script(token_ids=token_ids))
    judge = tmp_path / "spread.py"
    judge.write_text(JUDGE)
    try:
        out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(TERSE / "agent.py"), "--data",
                              str(TERSE / "tasks.jsonl"), "--limit", "4", "--judge", f"{judge}:spread", "--repeat",
                              "3", "--upstream", upstream.url, "--run-dir", str(tmp_path / "runs")],
                             capture_output=True, text=True, timeout=300)
    finally:
        upstream.close()
    assert out.returncode == 0, out.stderr[-3000:]
    db = tmp_path / "runs" / "harness.duckdb"
    (run_id,), = db_rows(db, "SELECT DISTINCT run_id FROM episode_outcomes")
    return db, run_id


def _export(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", "export", "--db", str(db), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hosted_run(tmp_path_factory) -> tuple[Path, str]:
    """A run recorded in front of an upstream that answers like a hosted API: text, no token ids."""
    return _record(tmp_path_factory.mktemp("hosted"), token_ids=False)


def test_a_hosted_style_run_exports_chat_records_datasets_loads_with_the_recorded_assistant_turns(hosted_run,
                                                                                                  tmp_path):
    db, run_id = hosted_run
    assert db_rows(db, "SELECT DISTINCT token_source FROM calls") == [("none",)]  # text only, as from a hosted API

    out = tmp_path / "sft.jsonl"
    done = _export(db, "--run", run_id, "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = datasets.load_dataset("json", data_files=str(out), split="train")
    episodes = db_rows(db, "SELECT episode_id FROM episode_outcomes ORDER BY task_id, repeat_index")
    assert sorted(rows["episode_id"]) == sorted(e for e, in episodes)  # one conversation per two-turn episode

    for row in rows:
        recorded = db_rows(db, "SELECT ch.text FROM calls c JOIN choices ch USING (call_id) WHERE c.episode_id = ? "
                           "ORDER BY c.call_index", [row["episode_id"]])
        learned = [m["content"] for m in row["messages"] if m["role"] == "assistant" and m["weight"] == 1]
        assert learned == [text for text, in recorded]
        first = json.loads(db_rows(db, "SELECT request FROM calls WHERE episode_id = ? AND call_index = 0",
                                   [row["episode_id"]])[0][0])
        assert [(m["role"], m["content"]) for m in row["messages"][:2]] == \
            [(m["role"], m["content"]) for m in first["messages"]]
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "user", "assistant"]

    # --where keeps the episodes a SQL predicate holds for (here the better half); parquet holds the same records.
    rewards = sorted(r for r, in db_rows(db, "SELECT reward FROM rewards"))
    kept = tmp_path / "best.parquet"
    done = _export(db, "--run", run_id, "--where", f"reward > {rewards[5]!r}", "--format", "parquet",
                   "--out", str(kept))
    assert done.returncode == 0, done.stderr
    best = db_rows(db, "SELECT episode_id FROM rewards ORDER BY reward DESC LIMIT 6")
    assert sorted(pq.read_table(kept).column("episode_id").to_pylist()) == sorted(e for e, in best)


def test_token_records_carry_the_engine_ids_the_mask_and_the_trainer_s_grpo_advantage(tmp_path):
    db, run_id = _record(tmp_path, token_ids=True)
    out = tmp_path / "rl.hf"
    done = _export(db, "--run", run_id, "--records", "tokens", "--format", "hf", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = datasets.load_from_disk(str(out))
    samples = db_rows(db, "SELECT sample_id, token_ids, loss_mask, logprobs, truncation FROM samples "
                      "WHERE run_id = ?", [run_id])
    assert len(rows) == len(samples) > 0
    by_id = {r["sample_id"]: r for r in rows}
    for sample_id, ids, mask, logprobs, truncation in samples:
        assert by_id[sample_id]["token_ids"] == ids and by_id[sample_id]["loss_mask"] == list(mask)
        assert by_id[sample_id]["logprobs"] == pytest.approx(logprobs)
        # the scripted engine's 8-token replies end "length" at the terse agent's max_tokens 8
        assert by_id[sample_id]["truncation"] == truncation == ["max_tokens"]

    episodes = db_rows(db, "SELECT episode_id, task_id, reward FROM rewards WHERE run_id = ? ORDER BY episode_id",
                       [run_id])
    expected = outcome_advantages(torch.tensor([r for _, _, r in episodes], dtype=torch.float64),
                                  [t for _, t, _ in episodes], "grpo")
    advantage = {e: float(a) for (e, _, _), a in zip(episodes, expected, strict=True)}
    assert any(a != 0 for a in advantage.values())  # the rewards differ within groups
    for row in rows:
        assert row["advantage"] == pytest.approx(advantage[row["episode_id"]], abs=1e-9)
        assert row["reward"] == dict((e, r) for e, _, r in episodes)[row["episode_id"]]


def test_bad_input_is_refused_with_what_to_do(hosted_run, tmp_path):
    db, run_id = hosted_run
    out = tmp_path / "x.jsonl"
    unknown = _export(db, "--run", "no-such-run", "--out", str(out))
    assert unknown.returncode == 2 and "no-such-run" in unknown.stderr and run_id in unknown.stderr
    bad_column = _export(db, "--run", run_id, "--where", "rewrd > 1", "--out", str(out))
    assert bad_column.returncode == 2 and "rewrd" in bad_column.stderr and "n_calls" in bad_column.stderr
    writes = _export(db, "--run", run_id, "--where", "true); DELETE FROM calls; SELECT (1", "--out", str(out))
    assert writes.returncode == 2 and "read-only" in writes.stderr
    assert not out.exists()
    assert db_rows(db, "SELECT count(*) FROM calls")[0][0] == 2 * 12
    out.write_text("keep me")
    exists = _export(db, "--run", run_id, "--out", str(out))
    assert exists.returncode == 2 and "exists" in exists.stderr and out.read_text() == "keep me"


def test_an_assistant_turn_the_agent_wrote_itself_is_context_not_a_target():
    """A few-shot example in the history is not the model's reply: weight 0. The calls' own answers: weight 1;
    an answer a later call went on from is not a record of its own, a branch (another choice) is."""
    few_shot = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    first = {"messages": [*few_shot, {"role": "user", "content": [{"type": "text", "text": "3+3?"}]}]}
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "6"},
                           {"role": "user", "content": "and 4+4?"}]}
    call = {"reasoning": None, "tool_calls": None}
    records = conversations([
        {**call, "call_id": "a", "request": json.dumps(first), "choice_index": 0, "text": "6"},
        {**call, "call_id": "a", "request": json.dumps(first), "choice_index": 1, "text": "six"},
        {**call, "call_id": "b", "request": json.dumps(second), "choice_index": 0, "text": "8"},
    ])
    assert [[(m["content"], m.get("weight")) for m in r["messages"]] for r in records] == [
        [("2+2?", None), ("4", 0), ("3+3?", None), ("six", 1)],
        [("2+2?", None), ("4", 0), ("3+3?", None), ("6", 1), ("and 4+4?", None), ("8", 1)],
    ]


def test_an_agent_that_trims_a_reply_before_sending_it_back_still_continues_the_conversation():
    first = {"messages": [{"role": "user", "content": "hi"}]}
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "bye"}]}
    call = {"reasoning": None, "tool_calls": None, "choice_index": 0}
    records = conversations([{**call, "call_id": "a", "request": json.dumps(first), "text": " hello\n"},
                             {**call, "call_id": "b", "request": json.dumps(second), "text": "ciao"}])
    assert [[(m["content"], m.get("weight")) for m in r["messages"]] for r in records] == [
        [("hi", None), ("hello", 1), ("bye", None), ("ciao", 1)]]


def test_columnar_exports_hold_tool_lists_whose_schemas_differ_as_json_text(tmp_path):
    tools = [[{"type": "function", "function": {"name": "a", "parameters": {"properties": {"x": {"default": 5}}}}}],
             [{"type": "function", "function": {"name": "b", "parameters": {"properties": {"x": {"default": "s"}}}}}]]
    rows = [{"messages": [{"role": "user", "content": "q"}], "tools": t, "episode_id": str(i)}
            for i, t in enumerate(tools)]
    assert write(iter(rows), tmp_path / "t.parquet", "parquet") == 2
    assert [json.loads(t) for t in pq.read_table(tmp_path / "t.parquet").column("tools").to_pylist()] == tools
    with pytest.raises(ExportError, match="choose one of"):
        write(iter(rows), tmp_path / "t.csv", "csv")
    assert not list(tmp_path.glob(".tmp-*"))


def test_retokenize_gives_text_only_calls_the_template_s_ids_marked_and_never_merged(hosted_run, tiny_model_dir,
                                                                                     tmp_path):
    from transformers import AutoTokenizer

    db = tmp_path / "copy.duckdb"
    shutil.copy(hosted_run[0], db)
    run_id = hosted_run[1]
    cli = [sys.executable, "-m", "harness.cli", "retokenize", "--model", str(tiny_model_dir), "--db", str(db)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "retokenized 24 calls (24 choices)" in done.stderr, done.stderr

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    before = dict(db_rows(hosted_run[0], "SELECT call_id, logprobs FROM choices"))
    rows = db_rows(db, "SELECT c.request, c.token_source, c.prompt_ids, ch.completion_ids, ch.logprobs, ch.text, "
                   "c.extra->>'$.retokenized.tokenizer', c.extra->'$.retokenized.upstream_logprobs.0', c.call_id "
                   "FROM calls c JOIN choices ch USING (call_id)")
    assert len(rows) == 24
    for request, source, prompt_ids, completion_ids, logprobs, text, by, upstream_lp, call_id in rows:
        assert (source, logprobs, by) == ("retokenized", None, str(Path(tiny_model_dir).resolve()))
        assert json.loads(upstream_lp) == before[call_id]  # the upstream's logprobs, of its own tokens: kept
        rendered = tokenizer.apply_chat_template(json.loads(request)["messages"], add_generation_prompt=True,
                                                 tokenize=False)
        assert tokenizer.decode(prompt_ids) == rendered
        assert tokenizer.decode(completion_ids) == text + "<|im_end|>"  # the turn, up to its end token
    again = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "retokenized 0 calls" in again.stderr  # only text-only calls, once

    # Never taken for engine ids: merging builds no RL samples from them, so no token records either.
    merged = subprocess.run([sys.executable, "-m", "harness.cli", "merge", "--db", str(db), "--run", run_id],
                            capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    assert db_rows(db, "SELECT count(*) FROM samples")[0][0] == 0
    out = tmp_path / "rl.jsonl"
    assert _export(db, "--run", run_id, "--records", "tokens", "--out", str(out)).returncode == 0
    assert out.read_text() == ""


HOSTED_AGENT = '''
import json, os
from openai import OpenAI

task = json.loads(os.environ["HARNESS_TASK"])
reply = OpenAI().chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": task["prompt"]}])
print(json.dumps({"answer": os.environ.get("HOSTED_KEY", "hidden") + " " + reply.choices[0].message.content}))
'''


def test_harness_run_record_only_against_a_hosted_style_api_sends_its_key_and_the_calls_as_sent(tmp_path):
    """`harness run --upstream URL --record-only --upstream-key-env NAME`: agents carry episode tokens, so the
    API gets the key from NAME (which the agents never see); each call goes on as the agent sent it."""
    agent = tmp_path / "agent.py"
    agent.write_text(HOSTED_AGENT)
    upstream = ScriptedUpstream(Script(token_ids=False))
    try:
        out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(agent), "--data",
                              str(TERSE / "tasks.jsonl"), "--limit", "3", "--upstream", upstream.url + "/v1",
                              "--record-only", "--upstream-key-env", "HOSTED_KEY", "--run-dir", str(tmp_path / "r")],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HOSTED_KEY": "sk-hosted-31"})
        requests, authorizations = upstream.engine.requests, upstream.engine.authorizations
    finally:
        upstream.close()
    assert out.returncode == 0, out.stderr[-3000:]
    assert authorizations == ["Bearer sk-hosted-31"] * 3
    assert all(set(r) == {"model", "messages"} and r["model"] == "gpt-4o-mini" for r in requests)
    db = tmp_path / "r" / "harness.duckdb"
    answers = db_rows(db, "SELECT answer FROM episode_outcomes")
    assert len(answers) == 3 and all(a.startswith("hidden w1000") for a, in answers)  # the key stayed hidden
    assert db_rows(db, "SELECT DISTINCT token_source, requested_model FROM calls") == [("none", "gpt-4o-mini")]
    assert not any(b"sk-hosted-31" in f.read_bytes() for f in (tmp_path / "r").rglob("*") if f.is_file())
