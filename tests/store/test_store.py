"""The DuckDB store, its schema contract (docs/schema.md), the read-only SQL check, and the Recorder.

Real DuckDB files in tmp_path; nothing is faked.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import struct
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import orjson
import pytest

from harness.core.flags import DEGENERATE, TRUNCATED, flag
from harness.core.records import CANCELLED, ENGINE, ERROR, NONE, OK, Call, Choice, Episode
from harness.store.database import (
    MIGRATIONS,
    ROW_GROUP_SIZE,
    SCHEMA_VERSION,
    SchemaVersionError,
    Store,
)
from harness.store.readonly import ReadOnlyError, check_read_only
from harness.store.recorder import Recorder, read_spill
from harness.store.sql import SqlError, run_sql

SCHEMA_DOC = Path(__file__).resolve().parents[2] / "docs" / "schema.md"
_rng = random.Random(1234)


def make_call(
    episode_id: str = "ep-0",
    call_index: int = 0,
    *,
    call_id: str | None = None,
    n_choices: int = 2,
    prompt_tokens: int = 2000,
    status: str = OK,
) -> Call:
    """A realistic call: a 2k-token prompt, ~200-token completions with logprobs, JSON request, response."""
    prompt_ids = [_rng.randrange(151_000) for _ in range(prompt_tokens)]
    choices = [
        Choice(
            index=i,
            completion_ids=[_rng.randrange(151_000) for _ in range(200 + i)],
            logprobs=[-_rng.expovariate(2.0) for _ in range(200 + i)],
            finish_reason="tool_calls" if i else "stop",
            text=f"answer {i} ✓",
            tool_calls=[{"id": "t1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
            if i
            else None,
            reasoning="thinking…" if i else None,
        )
        for i in range(n_choices)
    ]
    messages = [{"role": "user", "content": "word " * 1500}]
    request = {"model": "gpt-4o-mini", "messages": messages, "n": n_choices}
    return Call(
        call_id=call_id or uuid.uuid4().hex,
        run_id="run-1",
        episode_id=episode_id,
        call_index=call_index,
        endpoint="chat",
        stream=True,
        requested_model="gpt-4o-mini",
        served_model="policy",
        role_key="role-a",
        system_hash=None,
        tools_hash="tools-1",
        request=orjson.dumps(request),
        response=orjson.dumps({"id": "chatcmpl-1", "choices": [{"index": 0}]}) if status == OK else None,
        prompt_ids=prompt_ids,
        choices=choices if status == OK else [],
        token_source=ENGINE,
        status=status,
        http_status=200 if status == OK else 502,
        error=None if status == OK else "upstream went away",
        started_at=1_763_812_345.123456 + call_index,
        latency_ms=812.5,
        ttft_ms=35.25,
        weight_version=7,
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(len(c.completion_ids) for c in choices) if status == OK else None,
        extra={"temperature_override": 1.0},
    )


@pytest.fixture
def store(tmp_path: Path):
    store = Store.open(tmp_path / "runs" / "harness.duckdb")
    yield store
    store.close()


def count(store: Store, table: str) -> int:
    return store.query(f"SELECT count(*) FROM {table}").rows[0][0]


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


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
    con = duckdb.connect(":memory:")  # the file as the previous harness wrote it
    con.execute(f"ATTACH '{path}' AS harness")
    keyed = Store(path, con, read_only=False)
    keyed.add_calls(calls)
    with pytest.raises(duckdb.ConstraintException):  # the previous schema had the key...
        keyed.add_calls([calls[0]])
    keyed.close()
    with Store.open(path) as store:
        got = store.query("SELECT call_id, call_index, len(prompt_ids) FROM calls ORDER BY call_index").rows
        assert got == [(c.call_id, c.call_index, len(c.prompt_ids)) for c in calls]
        assert count(store, "choices") == 6 and count(store, "completions") == 6
        keys = store.query("SELECT count(*) FROM duckdb_constraints() WHERE table_name IN ('calls', 'choices') "
                           "AND constraint_type = 'PRIMARY KEY'").rows
        assert keys == [(0,)]  # ...and now none holds memory
        store.add_calls([make_call("ep-0", 3)])
        assert store.episode_progress("ep-0") == (False, 4, None)


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


# --- read-only SQL ----------------------------------------------------------------------------------------

ACCEPTED = [
    "SELECT 1",
    "with x as (select 1 as a) select * from x",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT * FROM r",
    "EXPLAIN SELECT * FROM calls",
    "explain analyze select count(*) from calls",
    "DESCRIBE calls",
    "SHOW TABLES",
    "SUMMARIZE choices",
    "FROM episodes",
    "VALUES (1, 'a')",
    "SELECT 1;",
    "PRAGMA table_info('calls')",
    "-- a comment\nSELECT 1 -- trailing",
]


@pytest.mark.parametrize("sql", ACCEPTED)
def test_check_read_only_accepts_reads(sql: str, store: Store):
    check_read_only(sql)
    store.query(sql)


REFUSED = [
    ("INSERT INTO runs VALUES ('r', now(), NULL, 'v', NULL)", "INSERT"),
    ("UPDATE calls SET status = 'ok'", "UPDATE"),
    ("DELETE FROM calls", "DELETE"),
    ("TRUNCATE calls", "DELETE"),
    ("CREATE TABLE t (a INTEGER)", "CREATE"),
    ("CREATE VIEW v AS SELECT 1", "CREATE"),
    ("CREATE MACRO m(x) AS x", "CREATE"),
    ("DROP TABLE calls", "DROP"),
    ("ALTER TABLE calls ADD COLUMN x INTEGER", "ALTER"),
    ("COPY calls TO '/tmp/harness-leak.csv'", "COPY"),
    ("ATTACH ':memory:' AS other", "ATTACH"),
    ("DETACH harness", "DETACH"),
    ("INSTALL httpfs", "LOAD"),
    ("LOAD httpfs", "LOAD"),
    ("SET threads = 1", "SET"),
    ("RESET threads", "SET"),
    ("PRAGMA threads = 1", "SET"),
    ("USE memory", "SET"),
    ("EXPORT DATABASE '/tmp/harness-export'", "EXPORT"),
    ("IMPORT DATABASE '/tmp/harness-export'", "PRAGMA"),
    ("CALL pragma_table_info('calls')", "CALL"),
    ("CHECKPOINT", "CALL"),
    ("BEGIN TRANSACTION", "TRANSACTION"),
    ("VACUUM", "VACUUM"),
    ("PREPARE p AS SELECT 1", "PREPARE"),
    ("MERGE INTO runs USING runs AS s ON true WHEN MATCHED THEN DELETE", "MERGE_INTO"),
    ("PIVOT calls ON status", "MULTI"),
    ("EXPLAIN ANALYZE DELETE FROM calls", "EXPLAIN"),
    ("SELECT 1; DROP TABLE calls", "DROP"),
    ("WITH x AS (INSERT INTO runs VALUES ('r', now(), NULL, 'v', NULL) RETURNING 1) FROM x", "INSERT"),
    ("SELECT * FROM (WITH x AS (DELETE FROM calls RETURNING *) SELECT * FROM x)", "DELETE"),
    ("WITH x AS (COPY calls TO '/tmp/harness-leak.csv') SELECT 1", "COPY"),
]


@pytest.mark.parametrize(("sql", "kind"), REFUSED, ids=[k + ":" + s[:30] for s, k in REFUSED])
def test_check_read_only_refuses_every_write_class(sql: str, kind: str):
    with pytest.raises(ReadOnlyError) as error:
        check_read_only(sql)
    message = str(error.value)
    assert "harness sql is read-only" in message and kind in message
    assert sql.split("; ")[-1][:40] in message  # quotes the offending statement


def test_one_statement_at_a_time():
    with pytest.raises(ReadOnlyError, match="one statement at a time: 'SELECT 1; SELECT 2' has 2"):
        check_read_only("SELECT 1; SELECT 2")


def test_the_message_quotes_at_most_80_characters_of_the_statement():
    with pytest.raises(ReadOnlyError) as error:
        check_read_only(f"DELETE FROM calls WHERE call_index IN ({', '.join(str(i) for i in range(100))})")
    quoted = re.search(r": '(.*)'$", str(error.value)).group(1)
    assert len(quoted) == 80 and quoted.startswith("DELETE FROM calls")


@pytest.mark.parametrize("sql", ["", "   ", " ; ;", "-- only a comment"])
def test_an_empty_query_is_refused_clearly(sql: str):
    with pytest.raises(ValueError, match="empty SQL query"):
        check_read_only(sql)


def test_store_query_refuses_a_write_hidden_in_a_cte_and_changes_nothing(store: Store, tmp_path: Path):
    store.add_calls([make_call()])
    leak = tmp_path / "leak.csv"
    for sql in (
        "WITH x AS (DELETE FROM calls RETURNING call_id) SELECT * FROM x",
        f"WITH x AS (COPY calls TO '{leak}') SELECT 1",
    ):
        with pytest.raises(ReadOnlyError):
            store.query(sql)
    assert count(store, "calls") == 1 and not leak.exists()


def test_a_closed_file_is_read_read_only_and_cannot_be_written_even_past_the_check(tmp_path: Path):
    path = tmp_path / "harness.duckdb"
    with Store.open(path) as store:
        store.add_calls([make_call(call_index=i, n_choices=1) for i in range(3)])
    result = run_sql(path, "SELECT call_index FROM calls ORDER BY 1", max_rows=2)
    assert result.rows == [(0,), (1,)] and result.truncated
    with pytest.raises(SqlError, match="read-only"):
        run_sql(path, "DELETE FROM calls")
    with Store.open(path, read_only=True) as store, store.cursor() as cur:
        with pytest.raises(duckdb.Error, match="read-only"):
            cur.execute("DELETE FROM calls")  # DuckDB itself refuses: the file is attached READ_ONLY
    assert run_sql(path, "SELECT count(*) FROM calls").rows == [(3,)]


def test_opening_a_missing_file_read_only_names_it(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no harness database at .*missing.duckdb"):
        Store.open(tmp_path / "missing.duckdb", read_only=True)
    with pytest.raises(SqlError, match="no database at .*missing.duckdb"):
        run_sql(tmp_path / "missing.duckdb", "SELECT 1")


# --- the recorder -----------------------------------------------------------------------------------------


def test_recorder_writes_when_a_batch_is_full(store: Store):
    with Recorder(store, max_batch=4, max_write=4, max_delay_s=60) as recorder:
        for i in range(3):
            recorder.record_call(make_call(call_index=i, n_choices=1))
        time.sleep(0.3)
        assert count(store, "calls") == 0 and recorder.pending == 3
        recorder.record_call(make_call(call_index=3, n_choices=1))
        assert wait_until(lambda: count(store, "calls") == 4)
        assert wait_until(lambda: recorder.pending == 0) and recorder.calls_written == 4


def test_recorder_writes_once_the_oldest_record_waited_max_delay(store: Store):
    with Recorder(store, max_batch=1000, max_delay_s=0.05) as recorder:
        recorder.record_episode(Episode("ep-0", "run-1", time.time(), "url"))
        recorder.record_call(make_call())
        assert wait_until(lambda: count(store, "calls") == 1 and count(store, "episodes") == 1, timeout=3)


def test_flush_makes_everything_recorded_before_it_visible(store: Store):
    with Recorder(store, max_batch=1000, max_delay_s=60) as recorder:
        recorder.record_episode(Episode("ep-0", "run-1", time.time(), "url"))
        for i in range(5):
            recorder.record_call(make_call(call_index=i))
        recorder.flush(timeout=10)
        assert (count(store, "calls"), count(store, "choices"), count(store, "episodes")) == (5, 10, 1)
        assert recorder.pending == 0
        recorder.flush()  # nothing pending: returns at once


def test_close_writes_what_is_buffered_is_idempotent_and_spills_late_records(store: Store):
    recorder = Recorder(store, max_batch=1000, max_delay_s=60)
    for i in range(7):
        recorder.record_call(make_call(call_index=i, n_choices=1))
    recorder.close()
    recorder.close()
    assert count(store, "calls") == 7 and recorder.calls_written == 7 and recorder.pending == 0
    late = make_call(call_index=7)
    recorder.record_call(late)  # a shutdown race: not written, not lost either
    assert recorder.calls_spilled == 1 and read_spill(recorder.spill_path) == [late]


def test_a_failing_row_is_spilled_and_the_rest_of_its_batch_lands(store: Store):
    existing = make_call(call_index=0)
    store.add_calls([existing])
    refused = dataclasses.replace(make_call(call_index=9), role_key=None)  # NOT NULL
    batch = [make_call(call_index=i) for i in (1, 2, 3)] + [refused]
    batch += [make_call(call_index=i) for i in (4, 5)]
    with Recorder(store, max_batch=1000, max_delay_s=60) as recorder:
        for call in batch:
            recorder.record_call(call)
        recorder.flush()
        assert (recorder.calls_written, recorder.calls_spilled, recorder.records_lost) == (5, 1, 0)
        assert "ConstraintException" in recorder.last_error
    assert count(store, "calls") == 6
    assert store.query("SELECT call_index FROM calls WHERE call_id = ?", [existing.call_id]).rows == [(0,)]
    lines = (store.path.parent / "harness.duckdb.spill.jsonl").read_bytes().splitlines()
    assert len(lines) == 1 and "NOT NULL constraint failed" in orjson.loads(lines[0])["error"]
    assert read_spill(store.path.parent / "harness.duckdb.spill.jsonl") == [refused]


def test_queries_from_other_threads_run_while_the_recorder_writes(store: Store):
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                store.query("SELECT count(*), sum(len(prompt_ids)) FROM calls")
            except BaseException as e:  # noqa: BLE001 - collected for the assert below
                errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    with Recorder(store, max_batch=8, max_delay_s=0.01) as recorder:
        for i in range(64):
            recorder.record_call(make_call(call_index=i, n_choices=1, prompt_tokens=500))
    done.set()
    thread.join()
    assert not errors and count(store, "calls") == 64


def test_a_full_row_group_batch_lands_whole(store: Store):
    """Batches of ROW_GROUP_SIZE calls take DuckDB's direct-to-file path instead of the WAL: same rows."""
    calls = [make_call(f"ep-{i // 8}", i % 8, n_choices=1, prompt_tokens=32) for i in range(ROW_GROUP_SIZE + 5)]
    with Recorder(store, max_batch=ROW_GROUP_SIZE, max_delay_s=60) as recorder:
        for call in calls:
            recorder.record_call(call)
    store.checkpoint()
    sql = "SELECT count(*), sum(len(prompt_ids)), sum(list_sum(prompt_ids)) FROM calls"
    expected = (len(calls), 32 * len(calls), sum(sum(c.prompt_ids) for c in calls))
    assert store.query(sql).rows == [expected]
    assert count(store, "choices") == len(calls)


def test_load_calls_gives_back_the_records_that_were_added(store: Store):
    first, second = make_call(), make_call()
    store.add_calls([first, second])
    loaded = {c.call_id: c for c in store.load_calls(first.episode_id)}
    for call in (first, second):
        got = loaded[call.call_id]
        assert got.prompt_ids == call.prompt_ids and got.role_key == call.role_key
        assert [c.completion_ids for c in got.choices] == [c.completion_ids for c in call.choices]
        assert got.choices[0].logprobs == pytest.approx(call.choices[0].logprobs, abs=1e-6)
        assert orjson.loads(got.request) == orjson.loads(call.request)
        assert abs(got.started_at - call.started_at) < 1e-6


def test_sql_over_a_folder_unions_every_database_file_in_it(tmp_path: Path):
    """`harness sql --db FOLDER`: runs that record into several files (one per verl agent-loop worker) read as one,
    tables and views alike; still read-only, and a file another process holds is named."""
    from harness.store.sql import SqlError, run_sql

    for k in range(3):
        with Store.open(tmp_path / "verl" / f"worker-{k}" / "harness.duckdb") as s:
            s.add_calls([make_call(f"ep-{k}", i, n_choices=1, prompt_tokens=10) for i in range(k + 1)])
    result = run_sql(tmp_path / "verl", "SELECT episode_id, count(*) FROM calls GROUP BY 1 ORDER BY 1")
    assert result.rows == [("ep-0", 1), ("ep-1", 2), ("ep-2", 3)]
    assert run_sql(tmp_path, "SELECT count(*) FROM completions").rows == [(6,)]  # a view of every file
    with pytest.raises(SqlError, match="read-only|only queries|not allowed"):
        run_sql(tmp_path, "DELETE FROM calls")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SqlError, match="no .duckdb files"):
        run_sql(tmp_path / "empty", "SELECT 1")
    held = Store.open(tmp_path / "verl" / "worker-1" / "harness.duckdb")  # a worker still recording
    try:
        with pytest.raises(SqlError, match="worker-1"):
            run_sql(tmp_path / "verl", "SELECT count(*) FROM calls")
        assert run_sql(tmp_path / "verl" / "worker-0", "SELECT count(*) FROM calls").rows == [(1,)]
    finally:
        held.close()
