"""Bad input to the verbs that read or write a database, and to `harness run` and `harness export`, as a user types
it: one line naming the value and what to do, exit code 2 (bad input, as argparse's own usage errors), and nothing
written or started first. `harness sql` keeps 1 for a query that ran and failed (its --help says so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.store.database import Store

ROOT = Path(__file__).resolve().parents[2]
TERSE = ROOT / "examples" / "terse_agent"
DB_VERBS = ["sql", "roles", "merge", "judge", "export", "retokenize"]


def _harness(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _db_argv(verb: str, db: Path, tmp_path: Path, model: str = "org/not-downloaded") -> list[str]:
    return {
        "sql": ["sql", "--db", str(db), "SELECT 1"],
        "roles": ["roles", "--db", str(db)],
        "merge": ["merge", "--db", str(db)],
        "judge": ["judge", "--judge", "exact_match", "--db", str(db)],
        "export": ["export", "--run", "r", "--db", str(db), "--out", str(tmp_path / "out.jsonl")],
        "retokenize": ["retokenize", "--model", model, "--db", str(db)],
    }[verb]


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("verb", DB_VERBS)
def test_a_missing_database_is_exit_2_for_every_verb(verb, tmp_path):
    db = tmp_path / "nope.duckdb"
    done = _harness(*_db_argv(verb, db, tmp_path), cwd=tmp_path)
    line = _one_error_line(done)
    assert done.returncode == 2 and "no database at" in line and str(db) in line and "--db" in line, line
    assert sorted(os.listdir(tmp_path)) == []  # nothing created: no database, no run folder, no export


@pytest.mark.parametrize("verb", DB_VERBS)
def test_a_text_file_as_the_database_is_named_not_a_duckdb_file(verb, tmp_path, request):
    """Not the hint to query through a proxy (a lock's): the file is no database at all."""
    db = tmp_path / "notes.txt"
    db.write_text("SELECT * FROM calls -- my notes\n")
    model = str(request.getfixturevalue("tiny_model_dir")) if verb == "retokenize" else "org/not-downloaded"
    done = _harness(*_db_argv(verb, db, tmp_path, model), cwd=tmp_path)
    line = _one_error_line(done)
    assert done.returncode == 2 and f"{db} is not a DuckDB database file" in line, line
    assert "harness.duckdb" in line and "proxy" not in line, line
    assert db.read_text() == "SELECT * FROM calls -- my notes\n" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_sql_tells_a_bad_query_from_a_bad_database_by_exit_code(tmp_path):
    db = tmp_path / "harness.duckdb"
    Store.open(db).close()
    done = _harness("sql", "--db", str(db), "SELECT no_such_column FROM calls", cwd=tmp_path)
    first = done.stderr.splitlines()[0]  # DuckDB's own message follows, with the caret under the column
    assert done.returncode == 1 and first.startswith("error: SQL error") and "no_such_column" in first, done.stderr
    written = _harness("sql", "--db", str(db), "DELETE FROM calls", cwd=tmp_path)
    assert written.returncode == 1 and "read-only" in _one_error_line(written)
    helped = _harness("sql", "--help", cwd=tmp_path)
    assert "1 when the query failed" in " ".join(helped.stdout.split()) and "2 on bad input" in helped.stdout


def test_roles_of_a_run_with_no_calls_is_bad_input(tmp_path):
    db = tmp_path / "harness.duckdb"
    Store.open(db).close()
    done = _harness("roles", "--db", str(db), "--run", "nope", cwd=tmp_path)
    line = _one_error_line(done)
    assert done.returncode == 2 and "no calls of run 'nope'" in line and "runs with calls: none" in line


def test_export_of_a_checkpoint_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / "runs" / "exp" / "checkpoints" / "step_9"
    done = _harness("export", "--checkpoint", str(missing), "--out", str(tmp_path / "model"), cwd=tmp_path)
    line = _one_error_line(done)
    assert done.returncode == 2 and f"--checkpoint {str(missing)!r} does not exist" in line, line
    assert "step_<k>" in line and "base model" not in line
    assert sorted(os.listdir(tmp_path)) == []  # no model directory written


@pytest.mark.parametrize("agent, says", [
    ([], "no agent given: give the agent's Python file"),
    ([str(TERSE / "agent.py"), "--cmd", "node agent.js"], "both an agent file"),
], ids=["neither", "both"])
def test_run_says_which_agent_mistake_it_is(agent, says, tmp_path):
    done = _harness("run", *agent, "--data", str(TERSE / "tasks.jsonl"), "--upstream", "http://127.0.0.1:9",
                    cwd=tmp_path)
    line = _one_error_line(done)
    assert done.returncode == 2 and says in line and "--cmd" in line, line
    if agent:
        assert "agent.py" in line and "node agent.js" in line and "give one of them" in line
    assert sorted(os.listdir(tmp_path)) == []  # no run folder: nothing started


@pytest.mark.parametrize("limit", ["0", "-3", "ten"])
def test_run_refuses_a_limit_below_one_naming_it(limit, tmp_path):
    done = _harness("run", str(TERSE / "agent.py"), "--data", str(TERSE / "tasks.jsonl"), "--limit", limit,
                    "--upstream", "http://127.0.0.1:9", cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 2 and len(errors) == 1, done.stderr  # argparse's usage line, then its one error
    named = f"{limit!r} is not a whole number" if limit == "ten" else f"{limit} is less than 1"
    assert "argument --limit" in errors[0] and named in errors[0] and "give --limit N, N >= 1" in errors[0], errors
    assert "no tasks in split" not in done.stderr and sorted(os.listdir(tmp_path)) == []
