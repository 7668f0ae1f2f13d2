"""The read-only check behind `harness sql`: only statements that read may run against recorded rollouts, and they
read the store alone.

DuckDB's own read-only mode covers a closed file; while the proxy owns the file, this check is what stands
between a user's SQL and the data, so it errs on the side of refusing. Every connection that runs user SQL is
confined (`confine`): once its database files are attached, DuckDB refuses any other file (read_text, read_csv,
read_parquet, read_json, glob, a path as a table name, ATTACH, COPY), through `harness sql`, the proxy's SQL
route and the viewer alike.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any

import duckdb

__all__ = ["ReadOnlyError", "check_read_only", "confine", "outside_files"]


class ReadOnlyError(ValueError):
    """A query that would change the database or the machine (harness sql is read-only)."""


# DuckDB reports these as SELECT-type query nodes. Since DuckDB 1.4 a CTE body can be an INSERT, UPDATE,
# DELETE or even COPY TO (`WITH x AS (COPY t TO 'f.csv') SELECT 1` writes a file), and such a statement is
# still typed SELECT, so SELECTs are checked node by node on their serialized parse tree.
_READ_ONLY_NODES = {"SELECT_NODE", "SET_OPERATION_NODE", "RECURSIVE_CTE_NODE", "CTE_NODE"}
_READ_ONLY_PRAGMAS = {"show_tables", "show_tables_expanded", "table_info", "database_size", "storage_info",
                      "version", "platform"}  # fmt: skip
_EXPLAIN_PREFIX = re.compile(r"\s*explain\s+(?:analy[sz]e\s+)?(?:\([^)]*\)\s*)?", re.IGNORECASE)
_PRAGMA_NAME = re.compile(r"\s*pragma\s+(\w+)", re.IGNORECASE)
_parser_lock = threading.Lock()
_parser_con: duckdb.DuckDBPyConnection | None = None


def confine(con: duckdb.DuckDBPyConnection) -> None:
    """From now on `con`'s database reads and writes only the files already attached to it (and its own spill
    files): DuckDB's external access off, which cannot be turned back on while it runs."""
    con.execute("SET enable_external_access = false")


def outside_files(exc: duckdb.Error) -> ReadOnlyError | None:
    """The refusal to give for a query DuckDB stopped at a file outside the store (None: another error)."""
    if isinstance(exc, duckdb.PermissionException):
        return ReadOnlyError(f"harness sql reads only the recorded rollouts, no other files: {exc}".split("\n")[0])
    return None


def check_read_only(sql: str) -> None:
    """Raise ReadOnlyError unless `sql` is one statement that only reads.

    Allowed: SELECT (with WITH, VALUES, FROM-first, DESCRIBE, SHOW, SUMMARIZE, PIVOT with an IN list),
    EXPLAIN of those, and the informational PRAGMAs in _READ_ONLY_PRAGMAS. Everything else is refused,
    including SET, CALL, COPY, ATTACH, INSTALL/LOAD, writes hidden in CTEs, and more than one statement. A syntax
    error propagates as DuckDB's ParserException.
    """
    if not isinstance(sql, str):
        raise TypeError(f"SQL must be a string, got {type(sql).__name__}")
    _check_text(sql)


@functools.lru_cache(maxsize=1024)
def _check_text(sql: str) -> None:
    """check_read_only's work; a text that passed is remembered (a refusal raises, and is never cached)."""
    try:
        statements = duckdb.extract_statements(sql)
    except ValueError as e:  # a statement type the Python client cannot name
        raise ReadOnlyError(f"harness sql is read-only: unrecognised statement in {sql[:80]!r} ({e})") from e
    if not statements:
        raise ValueError("empty SQL query: nothing to run (write a SELECT statement)")
    for statement in statements:
        _check_statement(statement.type.name, statement.query)
    if len(statements) > 1:
        raise ReadOnlyError(f"harness sql runs one statement at a time: {sql.strip()[:80]!r} has {len(statements)}")


def _check_statement(kind: str, query: str) -> None:
    def refuse(why: str) -> None:
        raise ReadOnlyError(f"harness sql is read-only: {why}: {query.strip()[:80]!r}")

    if kind == "SELECT":
        bad = _non_select_nodes(query)
        if bad:
            refuse(f"a SELECT that contains {', '.join(sorted(bad))}")
    elif kind == "EXPLAIN":
        prefix = _EXPLAIN_PREFIX.match(query)
        inner = duckdb.extract_statements(query[prefix.end() :]) if prefix else []
        if len(inner) != 1 or inner[0].type.name != "SELECT":
            refuse("EXPLAIN of a statement that is not a SELECT")
        _check_statement("SELECT", inner[0].query)
    elif kind == "PRAGMA":
        name = _PRAGMA_NAME.match(query)
        if not name or name.group(1).lower() not in _READ_ONLY_PRAGMAS:
            refuse(f"PRAGMA statement (allowed: {', '.join(sorted(_READ_ONLY_PRAGMAS))})")
    else:
        refuse(f"{kind} statement")


def _non_select_nodes(query: str) -> set[str]:
    """Query node types in a SELECT's parse tree that are not reads (e.g. INSERT_QUERY_NODE in a CTE)."""
    global _parser_con
    with _parser_lock:
        if _parser_con is None:
            _parser_con = duckdb.connect(":memory:")
        tree = json.loads(_parser_con.execute("SELECT json_serialize_sql(?)", [query]).fetchone()[0])
    if tree.get("error"):
        return {f"something DuckDB cannot serialize ({tree.get('error_message', '?')})"}
    found: set[str] = set()
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            kind = node.get("type")
            if isinstance(kind, str) and kind.endswith("_NODE") and kind not in _READ_ONLY_NODES:
                found.add(kind)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found
