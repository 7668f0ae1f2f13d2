"""`harness sql`: read-only SQL over recorded rollouts, whether or not a proxy is running.

DuckDB allows one process per database file. While a proxy owns the file, the query goes through that proxy's
read-only SQL route (found via the run-info file next to the database); otherwise the file is opened read-only.
Either way the same statement check refuses anything that is not a query.
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

from harness.readonly import ReadOnlyError, check_read_only
from harness.store import QueryResult, open_read_only_query
from proxy.server import discover


class SqlError(RuntimeError):
    """A query that could not run; the message says why and what to do."""


def run_sql(db_path: str | Path, query: str, *, max_rows: int | None = None) -> QueryResult:
    db_path = Path(db_path)
    try:
        check_read_only(query)
    except ReadOnlyError as exc:
        raise SqlError(str(exc)) from None
    except (ValueError, duckdb.Error) as exc:
        raise SqlError(f"SQL error: {exc}") from None
    if db_path.is_dir():
        return _over_files(db_path, query, max_rows)
    info = discover(db_path)
    if info is not None:
        return _via_proxy(info, query, max_rows)
    if not db_path.exists():
        raise SqlError(f"no database at {str(db_path)!r}: record something first, or pass --db PATH")
    try:
        return open_read_only_query(db_path, query, max_rows=max_rows)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise SqlError(
                f"{str(db_path)!r} is held by another process and no running proxy announces it "
                f"({db_path.name}.proxy.json): stop that process, or query through its proxy"
            ) from None
        raise SqlError(f"cannot read {str(db_path)!r}: {exc}") from None
    except duckdb.Error as exc:
        raise SqlError(f"SQL error: {exc}") from None


def _over_files(folder: Path, query: str, max_rows: int | None) -> QueryResult:
    """Every database file under `folder` as one: each table and view is the union (by column name) of its rows in
    every file. For runs that record into several files, e.g. one per verl agent-loop worker (docs/scale-out.md)."""
    paths = sorted(folder.rglob("*.duckdb"))
    if not paths:
        raise SqlError(f"no .duckdb files under {str(folder)!r}: pass a database file, or a folder that has some")
    con = duckdb.connect(":memory:")
    try:
        for k, path in enumerate(paths):
            quoted = "'" + str(path).replace("'", "''") + "'"
            try:
                con.execute(f"ATTACH {quoted} AS db{k} (READ_ONLY)")
            except duckdb.Error as exc:
                held = "lock" in str(exc).lower()
                raise SqlError(f"cannot read {str(path)!r}: " + (
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
        con.execute("BEGIN")
        try:
            cur = con.execute(query)
            description = cur.description or []
            rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows + 1)
        finally:
            con.execute("ROLLBACK")
    except duckdb.Error as exc:
        raise SqlError(f"SQL error: {exc}") from None
    finally:
        con.close()
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


def _via_proxy(info: dict, query: str, max_rows: int | None) -> QueryResult:
    body = orjson.dumps({"sql": query, "max_rows": max_rows})
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
        raise SqlError(f"the proxy at {info['url']} did not answer: {exc}") from None
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
