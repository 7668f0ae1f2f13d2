"""Another application's DuckDB file given where a harness database goes: every opening refuses it, naming the file
and its tables, and leaves it exactly as it was (its tables, its bytes, its mtime, no file beside it). The store
(read-write, read-only, the check commands make before an engine starts), the proxy's recorder, and every verb
that takes --db, run as a user types them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from harness.store.database import NotHarnessDatabaseError, Store, check_database
from tests.support import RunningProxy

ROOT = Path(__file__).resolve().parents[2]
TERSE = ROOT / "examples" / "terse_agent"


@pytest.fixture
def foreign(tmp_path) -> Path:
    """Another app's file: two tables with rows and a view, in a folder of its own."""
    path = tmp_path / "app" / "shop.duckdb"
    path.parent.mkdir()
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE customers (id INTEGER, name VARCHAR); INSERT INTO customers VALUES (1, 'Ada')")
    con.execute("CREATE TABLE orders (id INTEGER, customer INTEGER); INSERT INTO orders VALUES (7, 1)")
    con.execute("CREATE VIEW big_orders AS SELECT * FROM orders WHERE id > 5")
    con.close()
    return path


def _state(path: Path) -> tuple:
    """What must not change: the folder's files, the file's bytes and mtime, and its tables as DuckDB lists them."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = con.execute("SELECT table_name FROM duckdb_tables() ORDER BY 1").fetchall()
    finally:
        con.close()
    return (sorted(os.listdir(path.parent)), hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns,
            tables)


def test_every_opening_of_the_store_refuses_it_and_leaves_it_as_it_was(foreign):
    before = _state(foreign)
    for open_it in (lambda: Store.open(foreign), lambda: Store.open(foreign, read_only=True),
                    lambda: check_database(foreign)):
        with pytest.raises(NotHarnessDatabaseError) as refused:
            open_it()
        message = str(refused.value)
        assert str(foreign) in message and "(big_orders, customers, orders)" in message
        assert "not a harness database" in message and "runs/harness.duckdb" in message
    assert _state(foreign) == before
    assert before[3] == [("customers",), ("orders",)]


def test_a_proxy_does_not_record_into_it(foreign):
    """`harness serve --db` and `harness run` record through the proxy's store: it refuses at start."""
    before = _state(foreign)
    with pytest.raises(NotHarnessDatabaseError, match="shop.duckdb has tables"):
        RunningProxy("http://127.0.0.1:9", foreign, served_model="m")
    assert _state(foreign) == before


def test_a_new_or_empty_file_still_becomes_a_harness_database(tmp_path):
    """Only a file with tables and no harness schema is refused: a new path and an empty DuckDB file are ours."""
    empty = tmp_path / "empty.duckdb"
    duckdb.connect(str(empty)).close()
    for path in (tmp_path / "new.duckdb", empty):
        check_database(path)
        with Store.open(path) as store:
            assert store.query("SELECT count(*) FROM runs").rows == [(0,)]
        check_database(path)


def _harness(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


@pytest.mark.parametrize("verb", ["merge", "judge", "sql", "roles", "export", "retokenize", "run"])
def test_every_verb_refuses_it_in_one_line_with_exit_2(verb, foreign, tmp_path, request):
    db = str(foreign)
    model = str(request.getfixturevalue("tiny_model_dir")) if verb == "retokenize" else ""  # built only for it
    argv = {
        "merge": ["merge", "--db", db],
        "judge": ["judge", "--judge", "exact_match", "--db", db],
        "sql": ["sql", "--db", db, "SELECT 1"],
        "roles": ["roles", "--db", db],
        "export": ["export", "--run", "r", "--db", db, "--out", str(tmp_path / "out.jsonl")],
        "retokenize": ["retokenize", "--model", model, "--db", db],
        # the run's database is RUN_DIR/harness.duckdb: the other app's file, there; refused before any engine
        "run": ["run", str(TERSE / "agent.py"), "--data", str(TERSE / "tasks.jsonl"), "--upstream",
                "http://127.0.0.1:9", "--run-dir", str(foreign.parent)],
    }[verb]
    if verb == "run":
        foreign = foreign.rename(foreign.parent / "harness.duckdb")
    before = _state(foreign)
    done = _harness(*argv, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and str(foreign) in lines[0], lines
    assert "(big_orders, customers, orders) but no harness schema" in lines[0] and "harness.duckdb" in lines[0]
    assert _state(foreign) == before  # nothing written: no tables, no journal, no engine log, no episodes folder
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "runs").exists()
