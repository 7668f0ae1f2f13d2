"""The DuckDB store and its schema contract (docs/schema.md): migrations, writes and reads.

Real DuckDB files in tmp_path; nothing is faked.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import time
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import orjson
import pytest

from harness.core.flags import DEGENERATE, TRUNCATED, flag
from harness.core.records import CANCELLED, ERROR, NONE, Episode
from harness.store.arrow_tables import calls_table, choices_table
from harness.store.database import (
    MIGRATIONS,
    SCHEMA_VERSION,
    SchemaVersionError,
    Store,
)
from tests.store.support import count, make_call

SCHEMA_DOC = Path(__file__).resolve().parents[2] / "docs" / "schema.md"

# --- schema and migrations -------------------------------------------------------------------------------


def test_open_creates_the_schema_and_records_each_migration(store: Store):
    rows = store.query("SELECT version, name, applied_at FROM schema_migrations ORDER BY version").rows
    assert [(v, n) for v, n, _ in rows] == [(i + 1, name) for i, (name, _) in enumerate(MIGRATIONS)]
    assert all(isinstance(applied_at, datetime) for _, _, applied_at in rows)
    names = {r[0] for r in store.query("SHOW TABLES").rows}
    assert {"runs", "episodes", "calls", "choices", "completions", "episode_summary"} <= names


def test_reopening_applies_no_migration_twice_and_keeps_the_data(tmp_path: Path):
    path = tmp_path / "harness.duckdb"
    with Store.open(path) as store:
        store.add_calls([make_call()])
    with Store.open(path) as store:
        assert count(store, "schema_migrations") == SCHEMA_VERSION
        assert count(store, "calls") == 1


def test_an_older_file_is_migrated_read_write_and_refused_read_only(tmp_path: Path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER, name VARCHAR, applied_at TIMESTAMP)")
    con.execute(MIGRATIONS[0][1])
    con.execute("INSERT INTO schema_migrations VALUES (1, ?, now()::TIMESTAMP)", [MIGRATIONS[0][0]])
    con.close()
    expected = rf"{re.escape(str(path))} has schema version 1.*expects {SCHEMA_VERSION}"
    with pytest.raises(SchemaVersionError, match=expected):
        Store.open(path, read_only=True)
    with Store.open(path) as store:
        assert count(store, "schema_migrations") == SCHEMA_VERSION
        assert count(store, "completions") == 0
    Store.open(path, read_only=True).close()


def test_calls_recorded_under_primary_keys_are_kept_when_the_keys_go(tmp_path: Path):
    path = tmp_path / "keyed.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER, name VARCHAR, applied_at TIMESTAMP)")
    keys_go = [name for name, _ in MIGRATIONS].index("calls_without_primary_keys")
    for version, (name, sql) in enumerate(MIGRATIONS[:keys_go], start=1):  # the file before the keys went
        con.execute(sql)
        con.execute("INSERT INTO schema_migrations VALUES (?, ?, now()::TIMESTAMP)", [version, name])
    con.close()
    calls = [make_call("ep-0", i) for i in range(3)]
    con = duckdb.connect(str(path))  # the file as the previous harness wrote it: calls without the later columns
    con.register("old_calls", calls_table(calls).drop_columns(["role", "policy"]))
    con.register("old_choices", choices_table(calls))
    con.execute("INSERT INTO calls BY NAME SELECT * FROM old_calls")
    con.execute("INSERT INTO choices BY NAME SELECT * FROM old_choices")
    with pytest.raises(duckdb.ConstraintException):  # the previous schema had the key...
        con.execute("INSERT INTO calls BY NAME SELECT * FROM old_calls LIMIT 1")
    con.close()
    with Store.open(path) as store:
        got = store.query("SELECT call_id, call_index, len(prompt_ids) FROM calls ORDER BY call_index").rows
        assert got == [(c.call_id, c.call_index, len(c.prompt_ids)) for c in calls]
        assert count(store, "choices") == 6 and count(store, "completions") == 6
        keys = store.query("SELECT count(*) FROM duckdb_constraints() WHERE table_name IN ('calls', 'choices') "
                           "AND constraint_type = 'PRIMARY KEY'").rows
        assert keys == [(0,)]  # ...and now none holds memory
        store.add_calls([make_call("ep-0", 3)])
        assert store.episode_progress("ep-0") == (False, 4, None)


def test_calls_recorded_before_the_role_column_get_their_role_from_extra_and_no_policy(tmp_path: Path):
    path = tmp_path / "before-roles.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER, name VARCHAR, applied_at TIMESTAMP)")
    added = [name for name, _ in MIGRATIONS].index("calls_role_and_policy")
    for version, (name, sql) in enumerate(MIGRATIONS[:added], start=1):  # the file before the columns came
        con.execute(sql)
        con.execute("INSERT INTO schema_migrations VALUES (?, ?, now()::TIMESTAMP)", [version, name])
    insert = ("INSERT INTO calls (call_id, run_id, episode_id, call_index, endpoint, stream, role_key, request, "
              "token_source, status, http_status, started_at, latency_ms, weight_version, extra) "
              "VALUES (?, 'run-1', 'ep-0', ?, 'chat', false, ?, '{}', 'engine', 'ok', 200, now()::TIMESTAMP, 1.0, "
              "0, ?)")
    con.execute(insert, ["named", 0, "key-a", '{"role": "planner"}'])  # as the proxy wrote a matched call's role
    con.execute(insert, ["unnamed", 1, "key-b", "{}"])
    con.execute(insert, ["bare", 2, "key-b", None])
    con.close()
    with Store.open(path) as store:
        rows = store.query("SELECT call_id, role, policy FROM calls ORDER BY call_index").rows
        assert rows == [("named", "planner", None), ("unnamed", None, None), ("bare", None, None)]
        roles = store.query("SELECT role_key, role, calls, served_by, policy FROM roles ORDER BY role_key").rows
        assert roles == [("key-a", "planner", 1, "policy", None), ("key-b", None, 2, "policy", None)]
        assert [(c.role, c.policy) for c in store.load_calls("ep-0")] == [("planner", None), (None, None), (None, None)]
        store.add_calls([dataclasses.replace(make_call("ep-0", 3), role="planner", policy="planner")])  # and on
        assert store.query("SELECT role, policy FROM calls WHERE call_index = 3").rows == [("planner", "planner")]


def test_a_file_from_a_newer_harness_is_refused_naming_both_versions(tmp_path: Path):
    path = tmp_path / "future.duckdb"
    with Store.open(path) as store, store.cursor() as cur:
        sql = "INSERT INTO schema_migrations VALUES (?, 'from_the_future', now()::TIMESTAMP)"
        cur.execute(sql, [SCHEMA_VERSION + 1])
    for read_only in (False, True):
        with pytest.raises(SchemaVersionError) as error:
            Store.open(path, read_only=read_only)
        message = str(error.value)
        assert str(path) in message and f"version {SCHEMA_VERSION + 1}" in message
        assert f"up to {SCHEMA_VERSION}" in message and "upgrade harness" in message


def _documented_relations() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """{name: (table|view, [(column, type), ...])} parsed from docs/schema.md."""
    relations: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current = None
    for line in SCHEMA_DOC.read_text().splitlines():
        heading = re.match(r"^### `(\w+)` \((table|view)\)$", line)
        if heading:
            current = heading.group(1)
            relations[current] = (heading.group(2), [])
            continue
        row = re.match(r"^\| `(\w+)` \| ([A-Z]+(?:\[\])?) \|", line)
        if row and current:
            relations[current][1].append((row.group(1), row.group(2)))
    return relations


def test_every_table_and_view_column_is_documented_in_order_with_its_type(store: Store):
    documented = _documented_relations()
    actual = {
        name: "view" if kind == "VIEW" else "table"
        for name, kind in store.query(
            "SELECT table_name, table_type FROM information_schema.tables WHERE table_catalog = 'harness'"
        ).rows
    }
    assert {name: kind for name, (kind, _) in documented.items()} == actual
    for name, (_, columns) in documented.items():
        described = [(r[0], r[1]) for r in store.query(f"DESCRIBE {name}").rows]
        assert columns == described, f"docs/schema.md disagrees with the {name} the code creates"


def test_the_example_queries_in_the_schema_doc_run(store: Store):
    store.start_run("run-1", {"port": 8000}, "0.1.0")
    store.add_episodes([Episode("ep-0", "run-1", 1_763_812_000.0, "url")])
    store.add_calls([make_call(call_index=0), make_call(call_index=1, status=ERROR)])
    examples = re.findall(r"```sql\n(.*?)```", SCHEMA_DOC.read_text(), re.S)
    assert len(examples) >= 5
    for sql in examples:
        store.query(sql)


# --- writes and reads --------------------------------------------------------------------------------------


def _float32(values: list[float]) -> list[float]:
    return list(struct.unpack(f"{len(values)}f", struct.pack(f"{len(values)}f", *values)))


def _unix(ts: datetime) -> float:
    return ts.replace(tzinfo=UTC).timestamp()


def test_add_calls_round_trips_a_call_with_two_choices_exactly(store: Store):
    call = make_call()
    store.add_calls([call])
    with store.cursor() as cur:
        cur.execute("SELECT * FROM calls")
        names = [d[0] for d in cur.description]
        row = dict(zip(names, cur.fetchone(), strict=True))
        choices = cur.execute("SELECT * FROM choices ORDER BY choice_index").fetchall()
    for field in ("call_id", "run_id", "episode_id", "call_index", "endpoint", "stream", "requested_model",
                  "served_model", "role_key", "system_hash", "tools_hash", "prompt_ids", "token_source",
                  "status", "http_status", "error", "latency_ms", "ttft_ms", "weight_version",
                  "prompt_tokens", "completion_tokens"):  # fmt: skip
        assert row[field] == getattr(call, field), field
    assert json.loads(row["request"]) == json.loads(call.request)
    assert json.loads(row["response"]) == json.loads(call.response)
    assert json.loads(row["extra"]) == call.extra
    assert abs(_unix(row["started_at"]) - call.started_at) < 1e-6
    assert len(choices) == 2
    for stored, choice in zip(choices, call.choices, strict=True):
        call_id, index, completion_ids, logprobs, finish_reason, text, tool_calls, reasoning = stored
        assert (call_id, index, completion_ids) == (call.call_id, choice.index, choice.completion_ids)
        assert logprobs == _float32(choice.logprobs)  # FLOAT: exact to float32
        assert (finish_reason, text, reasoning) == (choice.finish_reason, choice.text, choice.reasoning)
        assert (json.loads(tool_calls) if tool_calls else None) == choice.tool_calls


def test_a_failed_call_without_ids_or_choices_is_stored_with_nulls(store: Store):
    failed = dataclasses.replace(make_call(status=CANCELLED), prompt_ids=None, token_source=NONE)
    store.add_calls([failed])
    row = store.query("SELECT prompt_ids, response, status, error FROM calls").rows[0]
    assert row == (None, None, CANCELLED, "upstream went away")
    assert store.query("SELECT choice_index, completion_tokens FROM completions").rows == [(None, None)]


def test_a_batch_with_a_refused_row_is_refused_whole(store: Store):
    store.add_calls([make_call()])
    with pytest.raises(duckdb.ConstraintException):
        store.add_calls([make_call(call_index=1), dataclasses.replace(make_call(call_index=2), role_key=None)])
    assert count(store, "calls") == 1 and count(store, "choices") == 2


def test_add_episodes_keeps_the_first_row_of_an_id(store: Store):
    store.add_episodes([Episode("ep-0", "run-1", 1_763_812_000.0, "url", {"task": "a"})])
    again = Episode("ep-0", "run-2", 1_763_813_000.0, "default")
    store.add_episodes([again, Episode("ep-1", "run-2", 0.0, "api")])
    rows = store.query("SELECT episode_id, run_id, source, meta FROM episodes ORDER BY episode_id").rows
    assert rows == [("ep-0", "run-1", "url", '{"task":"a"}'), ("ep-1", "run-2", "api", "{}")]


def test_runs_are_started_once_and_ended(store: Store):
    store.start_run("run-1", {"engine": {"url": "http://127.0.0.1:8001"}}, "0.1.0")
    with pytest.raises(ValueError, match="run 'run-1' already exists"):
        store.start_run("run-1", {}, "0.1.0")
    assert store.query("SELECT ended_at FROM runs").rows == [(None,)]
    store.end_run("run-1")
    sql = "SELECT started_at, ended_at, config ->> '$.engine.url' FROM runs"
    ((started, ended, config),) = store.query(sql).rows
    assert started <= ended and abs(_unix(ended) - time.time()) < 60 and config == "http://127.0.0.1:8001"
    with pytest.raises(ValueError, match="no run 'run-9'"):
        store.end_run("run-9")


def test_episode_progress_continues_an_episode(store: Store):
    assert store.episode_progress("ep-0") == (False, 0, None)
    store.add_episodes([Episode("ep-0", "run-1", 1.0, "url")])
    store.add_calls([make_call("ep-0", 0), make_call("ep-0", 1), make_call("ep-1", 0)])
    assert [store.episode_progress(e) for e in ("ep-0", "ep-1", "ep-2")] == [(True, 2, None), (False, 1, None),
                                                                             (False, 0, None)]
    flagged = [make_call("ep-3", k) for k in range(3)]  # its first degenerate finding: call 1's
    flagged[1].extra["flags"] = [flag(0, TRUNCATED, "max_tokens"), flag(1, DEGENERATE, "low_surprisal", 0.1, 0.5)]
    flagged[2].extra["flags"] = [flag(0, DEGENERATE, "repetition", 0.9, 0.5)]
    store.add_calls(flagged)
    assert store.episode_progress("ep-3", degenerate=True) == (False, 3, (1, "low_surprisal"))
    assert store.episode_progress("ep-3") == (False, 3, None)  # not asked


def test_views_summarise_episodes_and_completions(store: Store):
    store.add_episodes([Episode("ep-0", "run-1", 1.7e9, "url"), Episode("ep-empty", "run-1", 0, "x")])
    failed, orphan = make_call("ep-0", 1, status=ERROR), make_call("ep-orphan", n_choices=1)
    store.add_calls([make_call("ep-0", 0), failed, orphan])
    summary = {r[0]: r for r in store.query("SELECT * FROM episode_summary").rows}
    _, run_id, source, _, n_calls, n_errors, n_cancelled, prompt, completion, first, last, latency = (
        summary["ep-0"]
    )
    assert (run_id, source, n_calls, n_errors, n_cancelled) == ("run-1", "url", 2, 1, 0)
    assert (prompt, completion, latency) == (4000, 401, 1625.0) and first < last
    assert summary["ep-empty"][4:7] == (0, 0, 0) and summary["ep-orphan"][1:5] == ("run-1", None, None, 1)
    sql = "SELECT call_index, choice_index, completion_tokens, finish_reason, text FROM completions"
    rows = store.query(sql + " WHERE episode_id = 'ep-0' ORDER BY ALL").rows
    assert rows == [
        (0, 0, 200, "stop", "answer 0 ✓"),
        (0, 1, 201, "tool_calls", "answer 1 ✓"),
        (1, None, None, None, None),  # an error call has no choices
    ]


def test_query_reports_types_and_truncates_at_max_rows(store: Store):
    store.add_calls([make_call(call_index=i, n_choices=1) for i in range(3)])
    result = store.query("SELECT call_index, prompt_ids, request FROM calls ORDER BY call_index", max_rows=2)
    assert result.columns == ["call_index", "prompt_ids", "request"]
    assert result.types == ["INTEGER", "INTEGER[]", "JSON"]
    assert [r[0] for r in result.rows] == [0, 1] and result.truncated
    assert not store.query("SELECT 1 WHERE ? = 2", [2], max_rows=2).truncated


def test_load_calls_gives_back_the_records_that_were_added(store: Store):
    first, second = make_call(), dataclasses.replace(make_call(), role="planner", policy="planner")
    store.add_calls([first, second])
    loaded = {c.call_id: c for c in store.load_calls(first.episode_id)}
    for call in (first, second):
        got = loaded[call.call_id]
        assert got.prompt_ids == call.prompt_ids and got.role_key == call.role_key
        assert (got.role, got.policy) == (call.role, call.policy)
        assert [c.completion_ids for c in got.choices] == [c.completion_ids for c in call.choices]
        assert got.choices[0].logprobs == pytest.approx(call.choices[0].logprobs, abs=1e-6)
        assert orjson.loads(got.request) == orjson.loads(call.request)
        assert abs(got.started_at - call.started_at) < 1e-6
