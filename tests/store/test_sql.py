"""Read-only SQL over recorded rollouts: the check that lets only reads run, and `harness sql` over files and
folders. Real DuckDB files in tmp_path.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest

from harness.store.database import (
    Store,
)
from harness.store.readonly import ReadOnlyError, check_read_only
from harness.store.sql import SqlError, run_sql
from tests.store.support import count, make_call

SCHEMA_DOC = Path(__file__).resolve().parents[2] / "docs" / "schema.md"

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
