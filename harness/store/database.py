"""The DuckDB store: every recorded run, episode, call and sampled completion, and the training samples merged
from them (harness.core.merge), queryable with SQL.

The schema is a public API: users write SQL against these table, view and column names, so they are never
renamed or removed. `MIGRATIONS` is append-only; `Store.open` applies the ones a file lacks, in order, in one
transaction, and `docs/schema.md` documents every column (a test checks the two agree).

Writes are bulk: `add_calls` turns a batch of records into Arrow tables column by column and inserts each with
one `INSERT ... SELECT`, because per-row INSERTs of 2k-token calls run at ~150 rows/s. The proxy does not call
it directly: `harness.store.recorder.Recorder` batches calls on a background thread.

Threads: every public method runs on its own `Store.cursor()`, so the recorder's writer thread and query
threads can share a Store. A read-write Store locks the file for every other process: while a proxy runs,
query through it.

Crashes: what a killed proxy had answered but not yet written waits in the file's journal (harness/store/journal.py);
every read-write open replays it first, and a read-only open does too when it can take the file read-write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import orjson
import pyarrow as pa

from harness.core.flags import DEGENERATE
from harness.core.merge import Merged
from harness.core.records import Call, Episode, EpisodeOutcome, Judgement, Sample, Task
from harness.store.arrow_tables import (
    EPISODE_CALLS,
    EPISODE_CALLS_NO_BODIES,
    breaks_table,
    calls_of,
    calls_table,
    choices_table,
    episode_merges_table,
    samples_table,
    timestamps,
    to_json,
)
from harness.store.journal import journal_segments, pending_records, replay
from harness.store.readonly import check_read_only, confine, outside_files
from harness.store.schema import MIGRATIONS, SCHEMA_VERSION

__all__ = ["EPISODE_CALLS", "EPISODE_CALLS_NO_BODIES", "MIGRATIONS", "SCHEMA_VERSION", "ROW_GROUP_SIZE",
           "NotHarnessDatabaseError", "QueryResult", "SchemaVersionError", "Store", "calls_of", "check_database"]

log = logging.getLogger(__name__)


# Rows per row group. A transaction that appends a full row group has it compressed and written straight to
# the file, instead of to the WAL and again at the next checkpoint: ~2x the ingest rate for 2k-token calls
# (bench/recorder_ingest.py). The Recorder writes batches of this many calls under load.
ROW_GROUP_SIZE = 2048
_DATABASE = "harness"  # the name the file is attached under
_CONVERT_SLICE = 32  # calls converted between two GIL hand-overs (~1 ms of Python work for 2k-token calls)


class SchemaVersionError(RuntimeError):
    """The file's schema is older or newer than this code's, or its migration history differs."""


class NotHarnessDatabaseError(SchemaVersionError):
    """The file is not a harness database: not a DuckDB file at all, or another application's DuckDB file (tables,
    no harness schema). Refused by every opening and left untouched: adding our tables to another application's
    file would mix two schemas in one file, and a proxy recording into it locks that application out."""


_FIX = "pass a run's harness database (e.g. runs/harness.duckdb), or a new path to create one"


@dataclass(frozen=True, slots=True)
class QueryResult:
    columns: list[str]  # column names, in order
    types: list[str]  # DuckDB type of each column, e.g. "INTEGER[]"
    rows: list[tuple]  # at most max_rows rows
    truncated: bool  # True when the query had more rows than max_rows


# --- the store -----------------------------------------------------------------------------------------


class Store:
    """One DuckDB file. Use `Store.open`; every method is safe to call from several threads."""

    def __init__(self, path: Path, con: duckdb.DuckDBPyConnection, read_only: bool) -> None:
        self.path = path
        self.read_only = read_only
        self._con = con

    @classmethod
    def open(cls, path: str | Path, *, read_only: bool = False, memory_mb: int | None = None) -> Store:
        """Open (creating and migrating when read-write) the harness database at `path`.

        Read-only opens never migrate: they raise SchemaVersionError when the file's schema differs from this
        code's. A read-write open refuses a file written by a newer harness. `memory_mb` caps DuckDB's memory
        (its cache of table data above all; DuckDB's default is 80% of RAM), so a long-lived writer stays flat.
        """
        if memory_mb is not None and memory_mb < 16:
            raise ValueError(f"memory_mb {memory_mb!r} is too small for DuckDB: give at least 16 (MB)")
        path = Path(path)
        if read_only and not path.exists():
            raise FileNotFoundError(f"no harness database at {path}")
        if read_only and journal_segments(path):
            _recover_for_reader(path, memory_mb)
        if not read_only:
            path.parent.mkdir(parents=True, exist_ok=True)
        # The file is ATTACHed (an ATTACH option is the only way to set its row group size), so every cursor
        # must `USE harness`: take cursors from Store.cursor().
        con = duckdb.connect(":memory:")
        if memory_mb is not None:
            con.execute(f"SET memory_limit = '{int(memory_mb)}MB'")
        options = f"ROW_GROUP_SIZE {ROW_GROUP_SIZE}" + (", READ_ONLY" if read_only else "")
        quoted = "'" + str(path).replace("'", "''") + "'"
        try:
            con.execute(f"ATTACH {quoted} AS {_DATABASE} ({options})")
            con.execute(f"USE {_DATABASE}")
        except duckdb.IOException as e:
            con.close()
            if "not a valid duckdb database" in str(e).lower():
                raise NotHarnessDatabaseError(f"{path} is not a DuckDB database file: {_FIX}") from None
            hint = (" If a proxy is running on it, it holds the file read-write: query it through the proxy."
                    if "lock" in str(e).lower() else "")
            raise duckdb.IOException(f"cannot open harness database {path}: {e}.{hint}") from e
        store = cls(path, con, read_only)
        try:
            if read_only:
                store._check_schema(*store._applied_migrations())
            else:
                # Fewer, larger checkpoints: checkpoint work is per byte, but each one has a fixed cost.
                con.execute("SET checkpoint_threshold = '64MB'")
                store._migrate()
                replay(store)  # what a killed proxy answered but had not written yet (harness/store/journal.py)
            confine(con)  # user SQL runs on this connection: it reads the store, no other file
        except BaseException:
            con.close()
            raise
        return store

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new cursor on the harness database: one per thread or per task; close it when done."""
        cur = self._con.cursor()
        cur.execute(f"USE {_DATABASE}")
        return cur

    def checkpoint(self) -> None:
        """Write everything in the WAL into the database file (DuckDB also does it by itself)."""
        with self.cursor() as cur:
            cur.execute("CHECKPOINT")

    def close(self) -> None:
        self._con.close()  # checkpoints the file

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- schema -------------------------------------------------------------------------------------------

    def _foreign_tables(self) -> list[str]:
        """The tables and views of a file without a harness schema (no schema_migrations table): another
        application's, when there are any. Empty for a harness database and for an empty file."""
        with self.cursor() as cur:
            sql = ("SELECT table_name AS name FROM duckdb_tables() WHERE database_name = $1 AND NOT internal "
                   "UNION ALL SELECT view_name FROM duckdb_views() WHERE database_name = $1 AND NOT internal "
                   "ORDER BY name")
            names = [name for (name,) in cur.execute(sql, [_DATABASE]).fetchall()]
        return [] if "schema_migrations" in names else names

    def _refuse_foreign(self) -> None:
        """Refuse another application's DuckDB file before anything is written into it."""
        if names := self._foreign_tables():
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            raise NotHarnessDatabaseError(f"{self.path} has tables ({shown}) but no harness schema: it is not a "
                                          f"harness database, and harness leaves it as it is; {_FIX}")

    def _applied_migrations(self) -> tuple[int, list[str]]:
        with self.cursor() as cur:
            sql = "SELECT count(*) FROM duckdb_tables() WHERE database_name = ? AND table_name = ?"
            (known,) = cur.execute(sql, [_DATABASE, "schema_migrations"]).fetchone()
            sql = "SELECT name FROM schema_migrations ORDER BY version"
            rows = cur.execute(sql).fetchall() if known else []
        return len(rows), [name for (name,) in rows]

    def _check_schema(self, found: int, names: list[str]) -> None:
        if found == 0:
            self._refuse_foreign()
        expected = [name for name, _ in MIGRATIONS]
        if found > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.path} has schema version {found} but this harness knows up to {SCHEMA_VERSION} "
                f"(unknown migrations: {names[SCHEMA_VERSION:]}): upgrade harness to read it"
            )
        if names != expected[:found]:
            raise SchemaVersionError(
                f"{self.path} has migrations {names}, which are not a prefix of this harness's {expected}"
            )
        if self.read_only and found == 0:
            raise SchemaVersionError(f"{self.path} is an empty database: nothing was recorded into it; {_FIX}")
        if self.read_only and found < SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.path} has schema version {found}, this harness expects {SCHEMA_VERSION}: open it "
                "once read-write (e.g. start the proxy on it) to migrate it"
            )

    def _migrate(self) -> None:
        self._refuse_foreign()  # before the first write: another application's file stays as it is
        with self.cursor() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
                        "(version INTEGER, name VARCHAR, applied_at TIMESTAMP)")  # fmt: skip
            found, names = self._applied_migrations()
            self._check_schema(found, names)
            if found == SCHEMA_VERSION:
                return
            cur.begin()
            for version, (name, sql) in enumerate(MIGRATIONS[found:], start=found + 1):
                cur.execute(sql)
                row = [version, name, _utc(time.time())]
                cur.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", row)
            cur.commit()

    # --- writes -------------------------------------------------------------------------------------------

    def start_run(self, run_id: str, config: dict, harness_version: str) -> None:
        row = [run_id, _utc(time.time()), harness_version, to_json(config)]
        with self.cursor() as cur:
            try:
                cur.execute("INSERT INTO runs VALUES (?, ?, NULL, ?, ?)", row)
            except duckdb.ConstraintException as e:
                raise ValueError(f"run {run_id!r} already exists in {self.path}") from e

    def end_run(self, run_id: str) -> None:
        with self.cursor() as cur:
            sql = "UPDATE runs SET ended_at = ? WHERE run_id = ?"
            (updated,) = cur.execute(sql, [_utc(time.time()), run_id]).fetchone()
        if not updated:
            raise ValueError(f"no run {run_id!r} in {self.path} (start_run it first)")

    def add_episodes(self, episodes: Sequence[Episode]) -> None:
        """Insert episodes; ids already present are left as they are (an episode spans proxy restarts)."""
        if not episodes:
            return
        table = pa.table(
            {
                "episode_id": pa.array([e.episode_id for e in episodes], pa.string()),
                "run_id": pa.array([e.run_id for e in episodes], pa.string()),
                "created_at": timestamps([e.created_at for e in episodes]),
                "source": pa.array([e.source for e in episodes], pa.string()),
                "meta": pa.array([to_json(e.meta) for e in episodes], pa.string()),
            }
        )
        self._insert({"episodes": table}, verb="INSERT OR IGNORE INTO")

    def add_calls(self, calls: Sequence[Call]) -> None:
        """Insert calls and their choices in one transaction. A duplicate call_id fails the whole batch."""
        if not calls:
            return
        # Converted a slice at a time, letting go of the GIL in between: the proxy's event loop shares this
        # process, and Python would otherwise hand it the GIL back only every sys.getswitchinterval() (5 ms).
        calls_parts, choices_parts = [], []
        for i in range(0, len(calls), _CONVERT_SLICE):
            part = calls[i:i + _CONVERT_SLICE]
            calls_parts.append(calls_table(part))
            choices_parts.append(choices_table(part))
            time.sleep(0)
        self._insert({"calls": pa.concat_tables(calls_parts).combine_chunks(),
                      "choices": pa.concat_tables(choices_parts).combine_chunks()})

    def _insert(self, tables: dict[str, pa.Table], *, verb: str = "INSERT INTO",
                before: Sequence[tuple[str, list]] = ()) -> None:
        """Insert Arrow tables by column name in one transaction, after the statements in `before`."""
        with self.cursor() as cur:
            cur.begin()
            try:
                for sql, params in before:
                    cur.execute(sql, params)
                for name, table in tables.items():
                    if table.num_rows:
                        cur.register(f"_new_{name}", table)
                        cur.execute(f"{verb} {name} BY NAME SELECT * FROM _new_{name}")
                        cur.unregister(f"_new_{name}")
                cur.commit()
            except BaseException:
                _rollback(cur)
                raise

    def add_tasks(self, run_id: str, tasks: Sequence[Task]) -> None:
        """The tasks a run works on (ids already stored for the run are left as they are)."""
        table = pa.table({
            "run_id": pa.array([run_id] * len(tasks), pa.string()),
            "task_id": pa.array([t.task_id for t in tasks], pa.string()),
            "split": pa.array([t.split for t in tasks], pa.string()),
            "data": pa.array([to_json(t.data) for t in tasks], pa.string()),
        })
        self._insert({"tasks": table}, verb="INSERT OR IGNORE INTO")

    def add_outcome(self, o: EpisodeOutcome) -> None:
        row = [o.episode_id, o.run_id, o.task_id, o.repeat_index, o.attempt, o.status, o.exit_code, o.answer,
               o.error, _utc(o.started_at), o.duration_ms, o.log_path,
               None if o.sandbox is None else to_json(o.sandbox)]
        with self.cursor() as cur:
            cur.execute("INSERT INTO episode_outcomes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)

    def add_judgements(self, judgements: Sequence[Judgement]) -> None:
        rows = [[j.episode_id, j.judge, j.judge_hash, j.reward, to_json(j.details), j.error, _utc(j.created_at)]
                for j in judgements]
        if rows:
            with self.cursor() as cur:
                cur.executemany("INSERT INTO judgements VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def add_report(self, run_id: str, judge: str, report: dict) -> None:
        with self.cursor() as cur:
            cur.execute("INSERT INTO reports VALUES (?, ?, ?, ?)", [run_id, judge, _utc(time.time()), to_json(report)])

    def add_metrics(self, run_id: str, step: int, metrics: dict[str, float | None]) -> None:
        """One training step's metrics, one row per name (a name logged again at a step adds a row)."""
        now = _utc(time.time())
        with self.cursor() as cur:
            cur.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?)",
                            [[run_id, step, name, None if v is None else float(v), now] for name, v in metrics.items()])

    def add_merged(self, run_id: str, episode_id: str, merged: Merged, reward: float | None = None) -> None:
        """Store one episode's merge (harness.core.merge.merge_episode) under `run_id`, with `reward` in every sample's
        reward slot; what an earlier merge stored for the episode under that run is replaced, not duplicated."""
        self.add_merged_episodes(run_id, [(episode_id, merged, reward)])

    def add_merged_episodes(self, run_id: str, episodes: Sequence[tuple[str, Merged, float | None]]) -> None:
        """`add_merged` for many (episode_id, merged, reward) at once: one transaction, Arrow inserts."""
        if not episodes:
            return
        episode_ids = [episode_id for episode_id, _, _ in episodes]
        if len(set(episode_ids)) != len(episode_ids):
            raise ValueError(f"add_merged_episodes got an episode twice for run {run_id!r}: merge each once")
        now = time.time()
        tables = {"samples": samples_table(run_id, episodes, now), "merge_breaks": breaks_table(run_id, episodes),
                  "episode_merges": episode_merges_table(run_id, episodes, now)}
        sql = "DELETE FROM {} WHERE run_id = ? AND episode_id IN (SELECT unnest(?::VARCHAR[]))"
        self._insert(tables, before=[(sql.format(name), [run_id, episode_ids]) for name in tables])

    # --- reads --------------------------------------------------------------------------------------------

    def episode_progress(self, episode_id: str, *,
                         degenerate: bool = False) -> tuple[bool, int, tuple[int, str] | None]:
        """(whether the episode is recorded, the call_index of its next call, with `degenerate` its first degenerate
        finding as (call_index, reason), else None); buffered calls not counted."""
        sql = ("SELECT EXISTS (SELECT 1 FROM episodes WHERE episode_id = $1), "
               "(SELECT coalesce(max(call_index) + 1, 0) FROM calls WHERE episode_id = $1), "
               + ("(SELECT min((call_index, reason)) FROM flags WHERE episode_id = $1 AND kind = $2)" if degenerate
                  else "NULL"))  # a third of the lookup's time at 200k calls: only when the guard ends episodes
        with self.cursor() as cur:
            known, start, found = cur.execute(sql, [episode_id, *([DEGENERATE] if degenerate else [])]).fetchone()
            return bool(known), start, tuple(found) if found else None

    def query(
        self, sql: str, params: Sequence | dict | None = None, *, max_rows: int | None = None
    ) -> QueryResult:
        """Run read-only SQL (see check_read_only) in a transaction that is always rolled back."""
        check_read_only(sql)
        if max_rows is not None and max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 or None, got {max_rows}")
        with self.cursor() as cur:
            cur.begin()
            try:
                cur.execute(sql, params)
                description = cur.description or []
                rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows + 1)
            except duckdb.Error as exc:
                raise outside_files(exc) or exc from None
            finally:
                _rollback(cur)
        truncated = max_rows is not None and len(rows) > max_rows
        columns, types = [d[0] for d in description], [str(d[1]) for d in description]
        return QueryResult(columns, types, rows[:max_rows] if truncated else rows, truncated)


    def load_calls(self, episode_id: str) -> list[Call]:
        """An episode's calls as records, in call order (what the merger reads)."""
        return self.load_episodes_calls([episode_id]).get(episode_id, [])

    def load_episodes_calls(self, episode_ids: Sequence[str]) -> dict[str, list[Call]]:
        """Several episodes' calls in one query: {episode_id: calls in call order}; episodes without calls left out."""
        with self.cursor() as cur:
            cur.execute(EPISODE_CALLS, [list(episode_ids)])
            return calls_of([d[0] for d in cur.description], cur.fetchall())

    def load_samples(self, run_id: str | None = None, episode_id: str | None = None) -> list[Sample]:
        """Stored samples as records, with their reward slot (what a trainer reads): those of one run and/or one
        episode, or all; ordered by run, episode and sample_index."""
        sql = ("SELECT episode_id, role_key, call_ids, choice_indices, token_ids, loss_mask, logprobs, reward, "
               "coalesce(truncation, []) FROM samples "
               "WHERE (?::VARCHAR IS NULL OR run_id = ?) AND (?::VARCHAR IS NULL OR episode_id = ?) "
               "ORDER BY run_id, episode_id, sample_index")
        with self.cursor() as cur:
            rows = cur.execute(sql, [run_id, run_id, episode_id, episode_id]).fetchall()
        return [Sample(*row) for row in rows]

    def episode_calls(self, episode_id: str) -> list[dict]:
        """An episode's calls in order, as judges see them (request and response parsed)."""
        sql = ("SELECT call_index, status, http_status, request, response, prompt_tokens, completion_tokens, "
               "requested_model, role, extra->>'engine_fault' FROM calls WHERE episode_id = ? "
               "ORDER BY call_index")
        with self.cursor() as cur:
            rows = cur.execute(sql, [episode_id]).fetchall()
        keys = ("call_index", "status", "http_status", "request", "response", "prompt_tokens", "completion_tokens",
                "requested_model", "role", "engine_fault")
        calls = [dict(zip(keys, row, strict=True)) for row in rows]
        for call in calls:
            call["request"] = orjson.loads(call["request"]) if call["request"] else None
            call["response"] = orjson.loads(call["response"]) if call["response"] else None
        return calls


def check_database(path: str | Path) -> None:
    """Raise what a read-write `Store.open(path)` would refuse, without writing anything: a file that is not a
    DuckDB database or is another application's (NotHarnessDatabaseError), a newer harness's schema
    (SchemaVersionError), a file another process holds (duckdb.IOException). A missing file passes (the store
    creates it). For commands to call before their slow part (an engine start), so the refusal comes first."""
    path = Path(path)
    if not path.exists():
        return
    if path.is_dir():
        raise NotHarnessDatabaseError(f"{path} is a folder, not a database file: {_FIX}")
    con = duckdb.connect(":memory:")
    try:
        quoted = "'" + str(path).replace("'", "''") + "'"
        try:
            con.execute(f"ATTACH {quoted} AS {_DATABASE} (READ_ONLY)")
        except duckdb.IOException as e:
            if "not a valid duckdb database" in str(e).lower():
                raise NotHarnessDatabaseError(f"{path} is not a DuckDB database file: {_FIX}") from None
            hint = " Another process holds it: stop it, or give another path." if "lock" in str(e).lower() else ""
            raise duckdb.IOException(f"cannot open harness database {path}: {e}.{hint}") from None
        store = Store(path, con, read_only=False)  # checked as the read-write open would: an older schema is fine
        store._check_schema(*store._applied_migrations())
    finally:
        con.close()


def _recover_for_reader(path: Path, memory_mb: int | None) -> None:
    """A read-only open of a file whose journal holds records: write them in first (a read-write open replays the
    journal), unless another process holds the file; then say what the reader will not see."""
    try:
        Store.open(path, memory_mb=memory_mb).close()
    except (duckdb.Error, OSError, SchemaVersionError) as exc:
        if not journal_segments(path):
            return  # another process replayed it meanwhile
        log.warning("%s: its journal holds %d records (calls, episodes) that a proxy answered but had not written "
                    "into the file when it stopped; they are not in what this read-only opening shows. Open the "
                    "file read-write once to write them in: start the proxy on it (`harness serve --db %s`), or "
                    "query it again when no other process holds it (could not open it read-write now: %s)",
                    path, pending_records(path), path, exc)  # fmt: skip


def _rollback(cur: duckdb.DuckDBPyConnection) -> None:
    try:
        cur.rollback()
    except duckdb.Error:
        pass  # a failed statement already ended the transaction


def _utc(unix_seconds: float) -> datetime:
    """TIMESTAMP columns hold naive UTC."""
    return datetime.fromtimestamp(unix_seconds, UTC).replace(tzinfo=None)
