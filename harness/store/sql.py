"""`harness sql`: read-only SQL over recorded rollouts, whether or not a proxy is running.

DuckDB allows one process per database file. While a proxy owns the file, the query goes through that proxy's
read-only SQL route (found via the run-info file next to the database); otherwise the file is opened read-only.
Either way the same statement check refuses anything that is not a query.

Two errors, for two exit codes of `harness sql` and `harness roles`: DatabaseError when there is nothing to query
(no file, not a harness database, held by a process that announces no proxy; 2, like every bad input of the CLI),
SqlError when the query itself failed (1).
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import duckdb
import orjson

from harness.store.database import NotHarnessDatabaseError, QueryResult, SchemaVersionError, Store
from harness.store.live import discover
from harness.store.readonly import ReadOnlyError, check_read_only, confine, outside_files


class SqlError(RuntimeError):
    """A query that could not run; the message says why and what to do."""


class DatabaseError(SqlError):
    """No database to run the query on: a missing file, one that is not a harness database, or one held elsewhere."""


def run_sql(db_path: str | Path, query: str, params: list | None = None, *,
            max_rows: int | None = None) -> QueryResult:
    """Run one read-only query (with `?` parameters) on a database file, a live proxy's file, or a folder of files."""
    with Reader(db_path) as reader:
        return reader.query(query, params, max_rows=max_rows)


class Reader:
    """Read-only queries on one opening of a database: a closed file (opened read-only), a file a running proxy
    holds (queried through the proxy), or a folder of files read as one (each table the union of its rows in every
    file, by column name; the schema's views over those). Several queries share the opening:

        with Reader(path) as reader:
            reader.query("SELECT ...", [param])
    """

    def __init__(self, db_path: str | Path):
        self.db_path = Path(db_path)
        self._proxy: dict | None = None
        self._store: Store | None = None
        self._con: duckdb.DuckDBPyConnection | None = None

    def __enter__(self) -> Reader:
        path = self.db_path
        if path.is_dir():
            self._con = _open_folder(path)
            return self
        self._proxy = discover(path)
        if self._proxy is not None:
            return self
        if not path.exists():
            raise DatabaseError(f"no database at {str(path)!r}: record something first, or pass --db PATH")
        try:
            self._store = Store.open(path, read_only=True)
        except NotHarnessDatabaseError as exc:
            raise DatabaseError(str(exc)) from None
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise DatabaseError(f"{str(path)!r} is held by another process and no running proxy announces "
                                    f"it ({path.name}.proxy.json): stop that process, or query through its "
                                    "proxy") from None
            raise DatabaseError(f"cannot read {str(path)!r}: {exc}") from None
        except (duckdb.Error, ValueError, SchemaVersionError) as exc:
            raise DatabaseError(f"cannot read {str(path)!r}: {exc}") from None
        return self

    def __exit__(self, *exc_info) -> None:
        if self._store is not None:
            self._store.close()
        if self._con is not None:
            self._con.close()

    def query(self, query: str, params: list | None = None, *, max_rows: int | None = None) -> QueryResult:
        try:
            check_read_only(query)
        except ReadOnlyError as exc:
            raise SqlError(str(exc)) from None
        except (ValueError, duckdb.Error) as exc:
            raise SqlError(f"SQL error: {exc}") from None
        if self._proxy is not None:
            return _via_proxy(self._proxy, query, params, max_rows)
        try:
            if self._store is not None:
                return self._store.query(query, params, max_rows=max_rows)
            return _folder_query(self._con, query, params, max_rows)
        except ReadOnlyError as exc:
            raise SqlError(str(exc)) from None
        except duckdb.Error as exc:
            raise SqlError(str(outside_files(exc) or f"SQL error: {exc}")) from None


def _open_folder(folder: Path) -> duckdb.DuckDBPyConnection:
    """Every database file under `folder` attached read-only, as one: e.g. one file per verl agent-loop worker
    (docs/scale-out.md)."""
    paths = sorted(folder.rglob("*.duckdb"))
    if not paths:
        raise DatabaseError(f"no .duckdb files under {str(folder)!r}: pass a database file, or a folder that has some")
    con = duckdb.connect(":memory:")
    try:
        for k, path in enumerate(paths):
            quoted = "'" + str(path).replace("'", "''") + "'"
            try:
                con.execute(f"ATTACH {quoted} AS db{k} (READ_ONLY)")
            except duckdb.Error as exc:
                held = "lock" in str(exc).lower()
                if "not a valid duckdb database" in str(exc).lower():
                    raise DatabaseError(f"{path} is not a DuckDB database file: move it out of {folder}, or pass "
                                        "the database files one at a time with --db") from None
                raise DatabaseError(f"cannot read {str(path)!r}: " + (
                    "a running process holds it (a proxy still recording?): query it alone with --db, or after "
                    "the run" if held else str(exc))) from None
        tables = [set(r[0] for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [f"db{k}"]).fetchall())
            for k in range(len(paths))]
        for name in sorted(set.intersection(*tables)):
            union = " UNION ALL BY NAME ".join(f'SELECT * FROM db{k}.main."{name}"' for k in range(len(paths)))
            con.execute(f'CREATE TEMP VIEW "{name}" AS {union}')
        # the views are the schema's own, over the unions (a file's own views would read only that file)
        _create_views(con, [r[0] for r in con.execute(
            "SELECT sql FROM duckdb_views() WHERE database_name = 'db0' AND NOT internal").fetchall()])
        confine(con)
    except BaseException:
        con.close()
        raise
    return con


def _folder_query(con: duckdb.DuckDBPyConnection, query: str, params: list | None,
                  max_rows: int | None) -> QueryResult:
    con.execute("BEGIN")
    try:
        cur = con.execute(query, params)
        description = cur.description or []
        rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows + 1)
    finally:
        con.execute("ROLLBACK")
    truncated = max_rows is not None and len(rows) > max_rows
    return QueryResult([d[0] for d in description], [str(d[1]) for d in description],
                       rows[:max_rows] if truncated else rows, truncated)


def _create_views(con: duckdb.DuckDBPyConnection, statements: list[str]) -> None:
    """CREATE VIEW statements as temporary views, each after the views it reads."""
    pending = [re.sub(r"^\s*CREATE\s+VIEW", "CREATE TEMP VIEW", sql, count=1, flags=re.I) for sql in statements]
    while pending:
        failed = []
        for sql in pending:
            try:
                con.execute(sql)
            except duckdb.CatalogException:
                failed.append(sql)
        if len(failed) == len(pending):
            raise SqlError(f"cannot rebuild the schema's views over several files: {failed[0][:200]}")
        pending = failed


def _via_proxy(info: dict, query: str, params: list | None, max_rows: int | None) -> QueryResult:
    body = orjson.dumps({"sql": query, "params": params, "max_rows": max_rows}, default=str)
    req = urllib.request.Request(
        info["url"] + "/harness/sql", data=body, method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {info['admin_token']}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = str(exc)
        raise SqlError(message) from None
    except OSError as exc:
        raise DatabaseError(f"the proxy at {info['url']} did not answer: {exc}") from None
    return QueryResult(columns=data["columns"], types=data["types"], rows=[tuple(r) for r in data["rows"]],
                       truncated=data["truncated"])


def to_csv(result: QueryResult) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(result.columns)
    for row in result.rows:
        writer.writerow([_cell(v) for v in row])
    return out.getvalue()


def to_json(result: QueryResult) -> str:
    rows = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
    return orjson.dumps(rows, default=str, option=orjson.OPT_INDENT_2).decode()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return orjson.dumps(value, default=str).decode()
    return str(value)


def print_table(result: QueryResult, max_width: int = 60) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=False)
    for name, kind in zip(result.columns, result.types, strict=True):
        table.add_column(f"{name}\n[dim]{kind}[/dim]", overflow="fold", max_width=max_width)
    for row in result.rows:
        table.add_row(*[_clip(_cell(v), max_width * 3) for v in row])
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(table)
    note = f"{len(result.rows)} row{'s' if len(result.rows) != 1 else ''}"
    if result.truncated:
        note += " (truncated: raise --max-rows to see more)"
    console.print(f"[dim]{note}[/dim]")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
