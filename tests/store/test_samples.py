"""Merged samples in DuckDB: stored and read back exactly, re-merged without duplicates, summed into the merge
metrics views, built after a dataset run and a re-judge, and by `harness merge` on a file.

Real DuckDB files and real records; the dataset runs use the scripted engine and real agent subprocesses.
The tests on the real engine are in test_samples_engine.py."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest

from harness.core.merge import DRIFT, FIRST_CALL, MERGE_VERSION, N_BRANCH, SUB_AGENT, merge_episode
from harness.core.records import ENGINE, ERROR, OK, Call, Choice, Episode, Judgement, Task
from harness.running.dataset import rejudge, run_dataset
from harness.running.runner import RunConfig
from harness.running.vllm_server import attach
from harness.store.database import Store
from harness.store.samples import merge_database, merge_recorded
from harness.store.schema import MIGRATIONS
from tests.support import RunningProxy, db_rows

HARNESS = [sys.executable, "-m", "harness.cli"]


def call(episode: str, index: int, prompt: list[int], *completions: list[int], run: str = "run-1",
         status: str = OK) -> Call:
    """A call whose logprobs are exact in float32 (multiples of 1/8), so a DuckDB round trip changes nothing."""
    choices = [Choice(i, list(c), [-(j + 1) / 8 for j in range(len(c))], "stop", "x")
               for i, c in enumerate(completions)]
    return Call(call_id=f"{episode}-c{index}", run_id=run, episode_id=episode, call_index=index, endpoint="chat",
                stream=False, requested_model="m", served_model="p", role_key="r", system_hash="s", tools_hash=None,
                request=b"{}", response=b"{}", prompt_ids=list(prompt), choices=choices, token_source=ENGINE,
                status=status, http_status=200, error=None, started_at=1.7e9 + index, latency_ms=1.0, ttft_ms=None,
                weight_version=0)


def three_turns(episode: str, run: str = "run-1") -> list[Call]:
    """An append-only agent: each prompt is the previous prompt + reply + a tool result."""
    return [call(episode, 0, [1, 2, 3, 4], [10, 11], run=run),
            call(episode, 1, [1, 2, 3, 4, 10, 11, 5, 6], [12, 13, 14], run=run),
            call(episode, 2, [1, 2, 3, 4, 10, 11, 5, 6, 12, 13, 14, 7], [15], run=run)]


def drifted(episode: str, run: str = "run-1") -> list[Call]:
    """The second call's prompt re-tokenized the first reply (11 came back as 99); the third continues the second."""
    return [call(episode, 0, [1, 2, 3], [10, 11], run=run),
            call(episode, 1, [1, 2, 3, 10, 99, 5], [12], run=run),
            call(episode, 2, [1, 2, 3, 10, 99, 5, 12, 6], [13], [14], run=run)]


@pytest.fixture
def store(tmp_path):
    store = Store.open(tmp_path / "harness.duckdb")
    yield store
    store.close()


def stored(store: Store, episode: str) -> list[Call]:
    """Record the episode's calls (drifted ones for an id with "drift" in it) and read them back as the merger does."""
    store.add_calls(drifted(episode) if "drift" in episode else three_turns(episode))
    return store.load_calls(episode)


def rows(store: Store, sql: str, params=None) -> list[tuple]:
    return store.query(sql, params).rows


# --- storage -------------------------------------------------------------------------------------------------------


def test_stored_samples_come_back_equal_to_the_merge(store: Store):
    merged = merge_episode(stored(store, "ep-drift"))
    store.add_merged("run-1", "ep-drift", merged, reward=0.75)
    back = store.load_samples("run-1")
    assert back == [dataclasses.replace(s, reward=0.75) for s in merged.samples]
    assert len(back) == 3 and store.load_samples(episode_id="ep-drift") == back
    assert store.load_samples("run-2") == []
    sample_rows = rows(store, "SELECT sample_id, sample_index, n_tokens, n_trainable, merge_version, "
                              "typeof(loss_mask) FROM samples ORDER BY sample_index")
    assert sample_rows == [(f"run-1/ep-drift/{i}", i, len(s.token_ids), sum(s.loss_mask), MERGE_VERSION, "UTINYINT[]")
                           for i, s in enumerate(merged.samples)]
    breaks = rows(store, "SELECT call_id, choice_index, reason, position, ours, theirs FROM merge_breaks ORDER BY ALL")
    assert breaks == [("ep-drift-c0", 0, FIRST_CALL, None, None, None),
                      ("ep-drift-c1", 0, DRIFT, 4, [11], [99, 5]),
                      ("ep-drift-c2", 1, N_BRANCH, None, None, None)]


def test_a_sub_agents_timeline_is_stored_with_its_parent_call_and_tool_call(store: Store):
    task = "Summarise the failing tests in tests/ and say which file to fix first."
    spawn = call("ep-sub", 0, [1, 2, 3], [10, 11])
    agent_call = {"id": "toolu_1", "type": "function",
                  "function": {"name": "Agent", "arguments": json.dumps({"prompt": task})}}
    spawn = dataclasses.replace(spawn, choices=[dataclasses.replace(spawn.choices[0], tool_calls=[agent_call])])
    child = dataclasses.replace(call("ep-sub", 1, [7, 8], [20]),
                                request=json.dumps({"messages": [{"role": "user", "content": task}]}).encode())
    store.add_calls([spawn, child, call("ep-sub", 2, [1, 2, 3, 10, 11, 4], [12])])
    store.add_merged("run-1", "ep-sub", merge_episode(store.load_calls("ep-sub")), reward=1.0)
    sql = ("SELECT c.call_index, b.reason, p.call_index, b.parent_tool_call_id FROM merge_breaks AS b "
           "JOIN calls AS c USING (call_id) LEFT JOIN calls AS p ON p.call_id = b.parent_call_id ORDER BY ALL")
    assert rows(store, sql) == [(0, FIRST_CALL, None, None), (1, SUB_AGENT, 0, "toolu_1")]
    assert rows(store, "SELECT call_ids, reward FROM samples ORDER BY ALL") == [
        (["ep-sub-c0", "ep-sub-c2"], 1.0), (["ep-sub-c1"], 1.0)]  # merged apart, both with the episode's reward
    documented = rows(store, _documented_query("Which\nsub-agents each call started"))
    assert documented == [("ep-sub", 0, "toolu_1", 1, 3)]


def test_re_merging_an_episode_replaces_its_rows_and_leaves_the_others(store: Store):
    for episode in ("ep-a", "ep-b"):
        store.add_merged("run-1", episode, merge_episode(stored(store, episode)))
    store.add_merged("run-2", "ep-a", merge_episode(store.load_calls("ep-a")), reward=0.0)
    before = rows(store, "SELECT run_id, episode_id, count(*) FROM samples GROUP BY ALL ORDER BY ALL")
    store.add_merged("run-1", "ep-a", merge_episode(store.load_calls("ep-a")), reward=1.0)
    store.add_merged("run-1", "ep-a", merge_episode(store.load_calls("ep-a")), reward=1.0)
    assert rows(store, "SELECT run_id, episode_id, count(*) FROM samples GROUP BY ALL ORDER BY ALL") == before
    assert rows(store, "SELECT run_id, episode_id, reward FROM samples ORDER BY ALL") == [
        ("run-1", "ep-a", 1.0), ("run-1", "ep-b", None), ("run-2", "ep-a", 0.0)]
    assert rows(store, "SELECT count(*) FROM merge_breaks") == [(3,)]  # one first_call per episode and run
    assert rows(store, "SELECT count(*) FROM episode_merges") == [(3,)]
    with pytest.raises(ValueError, match="episode twice"):
        store.add_merged_episodes("run-1", [("ep-a", merge_episode([]), None)] * 2)


def test_a_failed_insert_leaves_the_previous_merge_in_place(store: Store):
    merged = merge_episode(stored(store, "ep-a"))
    store.add_merged("run-1", "ep-a", merged, reward=1.0)
    bad = dataclasses.replace(merged, samples=merged.samples + [dataclasses.replace(merged.samples[0], role_key=None)])
    with pytest.raises(duckdb.ConstraintException):
        store.add_merged("run-1", "ep-a", bad, reward=0.0)
    assert store.load_samples("run-1") == [dataclasses.replace(s, reward=1.0) for s in merged.samples]


# --- metrics views ---------------------------------------------------------------------------------------------------


def test_merge_metrics_of_an_append_only_episode_are_exact(store: Store):
    merged = merge_episode(stored(store, "ep-a"))
    store.add_merged("run-1", "ep-a", merged)
    per_call, tokens = (4 + 2) + (8 + 3) + (12 + 1), 13  # every prompt + completion, vs one sequence
    assert (merged.per_call_tokens, merged.merged_tokens) == (per_call, tokens)
    ((run, episodes, samples, calls, per_call_db, merged_db, ratio, drift_calls, followups, drift_rate,
      with_drift),) = rows(store, "SELECT * FROM merge_metrics")
    assert (run, episodes, samples, calls, per_call_db, merged_db) == ("run-1", 1, 1, 3, per_call, tokens)
    assert ratio == per_call / tokens
    assert (drift_calls, followups, drift_rate, with_drift) == (0, 2, 0.0, 0)
    assert rows(store, "SELECT reason, n FROM merge_reasons") == [(FIRST_CALL, 1)]


def test_a_drifted_episode_shows_in_the_drift_rate_and_the_reasons(store: Store):
    for episode in ("ep-a", "ep-drift"):
        store.add_merged("run-1", episode, merge_episode(stored(store, episode)))
    ((drift_calls, followups, drift_rate, with_drift),) = rows(
        store, "SELECT drift_calls, followup_calls, drift_rate, episodes_with_drift FROM merge_metrics")
    assert (drift_calls, followups, drift_rate, with_drift) == (1, 4, 0.25, 1)
    assert dict(rows(store, "SELECT reason, n FROM merge_reasons")) == {FIRST_CALL: 2, DRIFT: 1, N_BRANCH: 1}
    sql = ("SELECT b.episode_id, c.call_index, b.position FROM merge_breaks AS b JOIN calls AS c USING (call_id) "
           "WHERE b.reason = 'retokenization_drift'")
    assert rows(store, sql) == [("ep-drift", 1, 4)]


# --- merging recorded episodes ---------------------------------------------------------------------------------------


def test_merge_recorded_merges_each_episode_of_a_run_with_its_latest_judgement(store: Store):
    store.add_episodes([Episode(e, "run-1", 1.7e9, "url") for e in ("ep-a", "ep-drift", "ep-failed")])
    stored(store, "ep-a")
    stored(store, "ep-drift")
    store.add_calls([call("ep-failed", 0, [1, 2], [3], status=ERROR), call("ep-other", 0, [1], [2], run="run-2")])
    store.add_judgements([Judgement("ep-a", "j", "h", 0.0, {}, None, 1.0),
                          Judgement("ep-a", "j2", "h", 1.0, {}, None, 2.0),
                          Judgement("ep-drift", "j", "h", None, {}, "judge broke", 1.0)])
    summary = merge_recorded(store, "run-1")
    assert summary == {"episodes": 3, "samples": 4, "calls": 6, "per_call_tokens": 30 + 30, "merged_tokens": 13 + 23,
                       "merge_ratio": 60 / 36, "drift_calls": 1, "followup_calls": 4, "drift_rate": 0.25,
                       "reasons": {FIRST_CALL: 2, DRIFT: 1, N_BRANCH: 1}}
    assert rows(store, "SELECT episode_id, reward FROM samples GROUP BY ALL ORDER BY ALL") == [
        ("ep-a", 1.0), ("ep-drift", None)]  # the latest judgement; a failed judge leaves the slot empty
    assert rows(store, "SELECT episode_id, n_calls, n_samples FROM episode_merges WHERE episode_id = 'ep-failed'") == [
        ("ep-failed", 0, 0)]
    assert merge_recorded(store, "run-1") == summary  # idempotent
    assert rows(store, "SELECT count(*) FROM samples") == [(4,)]
    everything = merge_recorded(store)
    assert everything["episodes"] == 4 and rows(store, "SELECT DISTINCT run_id FROM samples ORDER BY 1") == [
        ("run-1",), ("run-2",)]
    with pytest.raises(ValueError, match=r"no run 'run-9' in .*harness.duckdb.*SELECT run_id"):
        merge_recorded(store, "run-9")


def test_an_older_file_is_migrated_and_merged(tmp_path):
    """A file recorded before the sample tables existed gets them on its first read-write open."""
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER, name VARCHAR, applied_at TIMESTAMP)")
    for version, (name, sql) in enumerate(MIGRATIONS[:3], start=1):
        con.execute(sql)
        con.execute("INSERT INTO schema_migrations VALUES (?, ?, now()::TIMESTAMP)", [version, name])
    con.close()
    with Store.open(path) as store:  # migrates, then records as an older harness would have
        store.add_calls(three_turns("ep-a"))
    assert merge_database(path)["samples"] == 1
    assert db_rows(path, "SELECT count(*) FROM schema_migrations") == [(len(MIGRATIONS),)]


# --- after a dataset run, and `harness merge` -----------------------------------------------------------------------

AGENT = textwrap.dedent('''
    import json, sys
    from openai import OpenAI
    task = json.loads(sys.stdin.read())
    client = OpenAI()
    messages = [{"role": "user", "content": task["q"]}]
    for turn in range(2):
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    print(json.dumps({"answer": task["answer"]}))
''')

JUDGES = textwrap.dedent('''
    def half(task, answer, calls):
        return 0.5
''')


async def test_a_dataset_run_and_a_rejudge_store_samples_with_the_rewards(upstream, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    tasks = [Task(f"t{i}", {"q": "hi", "answer": str(i)}) for i in range(2)]
    config = RunConfig(command=[sys.executable, str(agent)], judge="exact_match", repeat=2)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    db = tmp_path / "run" / "harness.duckdb"
    # The scripted engine answers every call with the same prompt ids: the second call is a retry of the first.
    assert report["merge"] == {"episodes": 4, "samples": 8, "calls": 8, "per_call_tokens": 8 * 40,
                               "merged_tokens": 8 * 40, "merge_ratio": 1.0, "drift_calls": 0, "followup_calls": 4,
                               "drift_rate": 0.0, "reasons": {FIRST_CALL: 4, N_BRANCH: 4}}
    assert db_rows(db, "SELECT count(*), count(DISTINCT episode_id), min(reward), max(reward) FROM samples "
                       "WHERE run_id = ?", [run_id]) == [(8, 4, 1.0, 1.0)]
    judges = tmp_path / "my_judges.py"
    judges.write_text(JUDGES)
    _, rejudged = await rejudge(db, run_id, f"{judges}:half")
    assert rejudged["merge"]["samples"] == 8
    assert db_rows(db, "SELECT count(*), min(reward), max(reward) FROM samples") == [(8, 0.5, 0.5)]


def test_harness_merge_on_a_file_prints_a_summary_and_is_idempotent(tmp_path):
    db = tmp_path / "harness.duckdb"
    with Store.open(db) as store:
        store.start_run("run-1", {}, "0.1.0")
        store.add_calls(three_turns("ep-a") + drifted("ep-drift"))
    for _ in range(2):
        out = subprocess.run(HARNESS + ["merge", "--db", str(db)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "merged 2 episodes (6 calls) into 4 samples" in out.stdout
        assert "merge ratio 1.67x" in out.stdout and "drift rate 25.0%: 1 of 4" in out.stdout
        assert "first_call 2, retokenization_drift 1, n_branch 1" in out.stdout
    assert db_rows(db, "SELECT count(*) FROM samples") == [(4,)]
    out = subprocess.run(HARNESS + ["merge", "--run-dir", str(tmp_path), "--run", "run-1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "merged 2 episodes" in out.stdout, out.stderr


def test_harness_merge_errors_name_the_file_or_run_and_what_to_do(upstream, tmp_path):
    missing = subprocess.run(HARNESS + ["merge", "--db", str(tmp_path / "nope.duckdb")], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "no database at" in missing.stderr and "nope.duckdb" in missing.stderr
    db = tmp_path / "harness.duckdb"
    Store.open(db).close()
    unknown = subprocess.run(HARNESS + ["merge", "--db", str(db), "--run", "run-9"], capture_output=True, text=True,
                             timeout=60)
    assert unknown.returncode == 2 and "no run 'run-9'" in unknown.stderr
    proxy = RunningProxy(upstream.url, db)
    try:
        time.sleep(0.1)
        live = subprocess.run(HARNESS + ["merge", "--db", str(db)], capture_output=True, text=True, timeout=60)
    finally:
        proxy.close()
    assert live.returncode == 2 and "is recording into" in live.stderr and "stop it" in live.stderr


def _documented_query(title: str) -> str:
    """The SQL that docs/schema.md shows under an example title: the docs' queries must run as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "schema.md").read_text()
    after = text.split(title, 1)[1]
    return after.split("```sql\n", 1)[1].split("```", 1)[0]


def test_harness_sql_answers_merge_ratio_drift_and_reasons_as_documented(tmp_path):
    db = tmp_path / "harness.duckdb"
    with Store.open(db) as store:
        for episode in ("ep-a", "ep-drift"):
            store.add_merged("run-1", episode, merge_episode(stored(store, episode)))

    def harness_sql(title: str) -> list[dict]:
        out = subprocess.run(HARNESS + ["sql", "--db", str(db), "--json", _documented_query(title)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    [ratio] = harness_sql("Merge ratio and drift rate per run:")
    per_call = sum(len(c.prompt_ids) + len(ch.completion_ids) for e in ("ep-a", "ep-drift")
                   for c in (three_turns(e) if e == "ep-a" else drifted(e)) for ch in c.choices)
    assert ratio["run_id"] == "run-1" and ratio["drift_rate"] == 0.25 and ratio["episodes_with_drift"] == 1
    assert ratio["merge_ratio"] == round(per_call / sum(
        len(s.token_ids) for e in ("ep-a", "ep-drift")
        for s in merge_episode(three_turns(e) if e == "ep-a" else drifted(e)).samples), 2)
    [drift] = harness_sql("Episodes with retokenization drift, where, and the tokens on both sides:")
    assert (drift["episode_id"], drift["call_index"], drift["position"]) == ("ep-drift", 1, 4)
    assert (drift["ours"], drift["theirs"]) == ([11], [99, 5])
    reasons = harness_sql("Why timelines started, per run (the reasons histogram):")
    assert {r["reason"]: r["n"] for r in reasons} == {FIRST_CALL: 2, DRIFT: 1, N_BRANCH: 1}
