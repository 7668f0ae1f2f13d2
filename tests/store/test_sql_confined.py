"""User SQL reads the store and nothing else, through all three entry points: `harness sql` (a closed file, a folder
of files, a live proxy's file through the proxy), the proxy's SQL route, and the viewer's SQL box. DuckDB's file
readers (read_text, read_blob, read_csv, read_parquet, read_json, glob, a path as a table name) are refused on
real files outside the store, with a message that says why; ordinary queries keep working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
import requests

from harness.store.database import Store
from harness.store.sql import SqlError, run_sql
from harness.viewer.app import Viewer, create_app
from tests.store.support import make_call
from tests.support import BackgroundApp, RunningProxy

WHY = "reads only the recorded rollouts"


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A folder of files a query must not read: text, CSV, Parquet and JSON, holding a secret."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "secret.txt").write_text("the secret\n")
    (folder / "secret.csv").write_text("secret\nthe secret\n")
    (folder / "secret.json").write_text(json.dumps([{"secret": "the secret"}]))
    con = duckdb.connect()
    con.execute(f"COPY (SELECT 'the secret' AS secret) TO '{folder / 'secret.parquet'}' (FORMAT parquet)")
    con.close()
    return folder


def readers(folder: Path) -> list[str]:
    return [f"SELECT content FROM read_text('{folder}/secret.txt')",
            f"SELECT content FROM read_blob('{folder}/secret.txt')",
            f"SELECT * FROM read_csv('{folder}/secret.csv')",
            f"SELECT * FROM read_csv_auto('{folder}/secret.csv')",
            f"SELECT * FROM '{folder}/secret.csv'",
            f"SELECT * FROM read_parquet('{folder}/secret.parquet')",
            f"SELECT * FROM parquet_metadata('{folder}/secret.parquet')",
            f"SELECT * FROM read_json('{folder}/secret.json')",
            f"SELECT * FROM read_json_auto('{folder}/secret.json')",
            f"SELECT * FROM glob('{folder}/*')",
            "SELECT * FROM glob('/etc/*')",
            "SELECT content FROM read_text('/etc/hostname')",
            f"SELECT count(*) FROM calls WHERE EXISTS (SELECT 1 FROM read_text('{folder}/secret.txt'))"]


def _store(path: Path, episode: str = "ep-0") -> Path:
    with Store.open(path) as store:
        store.add_calls([make_call(episode, 0, n_choices=1, prompt_tokens=10)])
    return path


def test_harness_sql_on_a_closed_file_and_a_folder_reads_the_store_alone(tmp_path, outside):
    db = _store(tmp_path / "one" / "harness.duckdb")
    _store(tmp_path / "many" / "a.duckdb", "ep-a")
    _store(tmp_path / "many" / "b.duckdb", "ep-b")
    for where in (db, tmp_path / "many"):
        assert run_sql(where, "SELECT count(*) FROM calls").rows[0][0] >= 1  # ordinary queries work
        assert run_sql(where, "SELECT count(*) FROM completions").rows  # the schema's views too
        for query in readers(outside):
            with pytest.raises(SqlError, match=WHY) as refused:
                run_sql(where, query)
            assert "the secret" not in str(refused.value)


def test_the_command_line_refuses_with_the_reason_and_exit_status(tmp_path, outside):
    db = _store(tmp_path / "harness.duckdb")
    done = subprocess.run([sys.executable, "-m", "harness.cli", "sql", "--db", str(db),
                           f"SELECT content FROM read_text('{outside}/secret.txt')"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and WHY in done.stderr and "the secret" not in done.stdout + done.stderr


def test_the_proxys_sql_route_and_harness_sql_through_it(upstream, tmp_path, outside):
    proxy = RunningProxy(upstream.url, tmp_path / "live.duckdb")
    try:
        route = proxy.url + "/harness/sql"
        ok = requests.post(route, json={"sql": "SELECT 41 + 1 AS x"}, headers=proxy.admin_headers, timeout=30)
        assert ok.status_code == 200 and ok.json()["rows"] == [[42]]
        for query in readers(outside):
            resp = requests.post(route, json={"sql": query}, headers=proxy.admin_headers, timeout=30)
            assert resp.status_code == 403, (query, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "read_only" and WHY in error["message"] and "the secret" not in resp.text
        with pytest.raises(SqlError, match=WHY):  # `harness sql --db live.duckdb` goes through the proxy
            run_sql(tmp_path / "live.duckdb", f"SELECT * FROM read_csv('{outside}/secret.csv')")
        still = requests.post(route, json={"sql": "SELECT count(*) FROM calls"}, headers=proxy.admin_headers,
                              timeout=30)
        assert still.status_code == 200  # the recording store is unharmed by the refusals
    finally:
        proxy.close()


def test_the_viewers_sql_box(tmp_path, outside):
    db = _store(tmp_path / "harness.duckdb")
    app = BackgroundApp(create_app(Viewer(db)))
    try:
        ok = requests.post(f"{app.url}/api/sql", json={"sql": "SELECT count(*) AS n FROM calls"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["rows"] == [[1]]
        for query in readers(outside):
            resp = requests.post(f"{app.url}/api/sql", json={"sql": query}, timeout=30)
            assert resp.status_code == 400 and WHY in resp.json()["error"]["message"], (query, resp.text)
            assert "the secret" not in resp.text
    finally:
        app.close()
