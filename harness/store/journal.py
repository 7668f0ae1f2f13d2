"""The recorder's journal: what a killed proxy had answered but not yet written to DuckDB, replayed at the next open.

The Recorder batches calls in memory for up to its batch interval; a proxy killed meanwhile (SIGKILL, the OOM
killer) would lose calls its agents were already answered. So every record handed to the Recorder is first written
to the journal, one `os.write` to the OS, before the answer it records leaves the proxy (proxy/forward.py: a stream's
record is journaled before its last chunk goes out). A write to the OS outlives the process; it is not an fsync, so a
power loss or kernel crash can still lose what the OS had not written to disk: at most the calls of the batch not yet
committed (DuckDB's commit syncs its own log), i.e. those answered in the last batch interval (0.2 s by default).

Files: segments `<db>.journal.<n>`, append-only, one JSON line per record (`{"kind": "call"|"episode", "record":
{...}}`, the spill file's format). When the recorder's writer takes every buffered record into one batch it seals
the current segment; once that batch is committed, the sealed segments are deleted (commit first, then delete: a
crash between the two replays records already in the file, and replay skips those). `Store.open` replays what is
left, read-write before anything else touches the file (harness/store/database.py), and deletes it: the proxy's
restart, `harness sql` on the closed file and any other opening of it recover the calls.

Replay is idempotent: episodes are inserted or ignored, calls whose call_id the file has are skipped, and of two
records of one call the later wins (a stream's record journaled before its last chunk, then its final one). A line
that does not parse is skipped: the last one of a segment was cut short by the kill (its answer never left); one
elsewhere (a power loss can leave zeros) keeps its segment on disk as `<db>.journal.<n>.unreadable`, and is logged.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from harness.core.records import Call, Choice, Episode

if TYPE_CHECKING:
    from harness.store.database import Store

__all__ = ["Journal", "decode_record", "encode_record", "journal_segments", "pending_records", "replay"]

log = logging.getLogger(__name__)

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE


def journal_segments(db_path: str | Path) -> list[Path]:
    """The journal segments of a database, oldest first."""
    db_path = Path(db_path)
    prefix = db_path.name + ".journal."
    found = []
    for path in db_path.parent.glob(prefix + "*"):
        number = path.name[len(prefix) :]
        if number.isdigit():
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def pending_records(db_path: str | Path) -> int:
    """How many records a database's journal holds (calls and episodes, a stream's early record counted too)."""
    return sum(path.read_bytes().count(b"\n") for path in journal_segments(db_path))


class Journal:
    """The append side, owned by one Recorder. Not thread-safe: the Recorder calls it under its lock."""

    def __init__(self, db_path: str | Path):
        self.db_path = Path(db_path)
        existing = journal_segments(self.db_path)  # left by a store opened read-only; never overwritten
        self._next = int(existing[-1].name.rsplit(".", 1)[1]) + 1 if existing else 1
        self._fd: int | None = None
        self._path: Path | None = None
        self._sealed: list[Path] = []  # segments whose records are all in a batch being (or to be) written
        self._torn = False  # a write failed part-way: the next record starts on a new line
        self.failures = 0  # records that could not be journaled (see the log)

    def append(self, line: bytes) -> None:
        """Write one encoded record to the OS. A failure (a full disk) is logged and counted, never raised: the
        record is still in the recorder's memory."""
        try:
            if self._fd is None:
                self._path = self.db_path.with_name(f"{self.db_path.name}.journal.{self._next}")
                self._next += 1
                self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            data = b"\n" + line if self._torn else line
            while data:
                data = data[os.write(self._fd, data) :]
            self._torn = False
        except OSError as exc:
            self._torn = True
            self.failures += 1
            if self.failures == 1 or self.failures % 1000 == 0:
                log.error("journal: could not write to %s (%s): %d records not journaled so far; a crash now would "
                          "lose them", self._path, exc, self.failures)  # fmt: skip

    def seal(self, carry: Iterable[bytes] = ()) -> list[Path]:
        """Every record appended so far is in the batch about to be written: close the current segment and hand
        over all sealed segments, to `remove` once the batch is committed (or `unseal` if it is held back).
        `carry`: records that must outlive them (a stream's early record whose final one has not come yet)."""
        if self._fd is not None:
            os.close(self._fd)
            self._sealed.append(self._path)
            self._fd = None
        sealed, self._sealed = self._sealed, []
        for line in carry:
            self.append(line)
        return sealed

    def unseal(self, segments: list[Path]) -> None:
        """The batch was held back (a full disk): its segments stay until a later batch is committed."""
        self._sealed[:0] = segments

    @staticmethod
    def remove(segments: list[Path]) -> None:
        for path in segments:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # replayed (and skipped) at the next open
                log.warning("journal: could not delete %s (%s)", path, exc)

    def close(self, *, keep: bool) -> list[Path]:
        """Close the current segment; returns the segments to delete now (none with `keep`)."""
        if self._fd is not None:
            os.close(self._fd)
            self._sealed.append(self._path)
            self._fd = None
        sealed, self._sealed = self._sealed, []
        return [] if keep else sealed


# --- records as JSON lines (the spill file's format too) -----------------------------------------------------


def encode_record(kind: str, record: Call | Episode, **more: object) -> bytes:
    """One record as a JSON line: {"kind", **more, "record"}. orjson writes the frozen dataclasses itself."""
    return orjson.dumps({"kind": kind, **more, "record": record}, default=_encode_bytes, option=_OPTIONS)


def decode_record(entry: dict) -> Call | Episode:
    """A record from an entry of `encode_record` (parsed)."""
    fields = entry["record"]
    if entry["kind"] == "episode":
        return Episode(**fields)
    if entry["kind"] == "call":
        for name in ("request", "response"):
            fields[name] = _decode_bytes(fields[name])
        fields["choices"] = [Choice(**choice) for choice in fields["choices"]]
        return Call(**fields)
    raise ValueError(f"unknown record kind {entry['kind']!r}, expected call or episode")


def _encode_bytes(value: object) -> object:
    """orjson fallback: bytes as text when they are UTF-8 (JSON bodies always are), else base64."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode()}
    return repr(value)  # never lose a record over an unserialisable note in `extra`


def _decode_bytes(value: str | dict | None) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return base64.b64decode(value["base64"])
    return value.encode()


# --- replay at open ---------------------------------------------------------------------------------------------


def replay(store: Store) -> tuple[int, int]:
    """Write what the journal of `store` (open read-write) holds and the file lacks, then delete the journal.
    Returns (episodes, calls) written. A record DuckDB refuses goes to the recorder's spill file, as it would have."""
    segments = journal_segments(store.path)
    if not segments:
        return 0, 0
    episodes: dict[str, Episode] = {}
    calls: dict[str, Call] = {}
    unreadable = []
    for path in segments:
        if not _read_segment(path, episodes, calls):
            unreadable.append(path)
    with store.cursor() as cur:
        sql = "SELECT call_id FROM calls WHERE call_id IN (SELECT unnest(?::VARCHAR[]))"
        have = {call_id for (call_id,) in cur.execute(sql, [list(calls)]).fetchall()}
    new_calls = [call for call_id, call in calls.items() if call_id not in have]
    _insert(store, store.add_episodes, list(episodes.values()), "episode")
    _insert(store, store.add_calls, new_calls, "call")
    for path in segments:
        if path in unreadable:
            path.rename(path.with_name(path.name + ".unreadable"))
        else:
            path.unlink(missing_ok=True)
    if new_calls:
        log.warning("%s: wrote %d calls a proxy had answered but not yet written when it stopped (from its journal)",
                    store.path, len(new_calls))  # fmt: skip
    return len(episodes), len(new_calls)


def _read_segment(path: Path, episodes: dict[str, Episode], calls: dict[str, Call]) -> bool:
    """Read one segment into `episodes` and `calls` (later records win); False if a line other than a cut-short last
    one did not parse."""
    lines = path.read_bytes().split(b"\n")
    readable = True
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = decode_record(orjson.loads(line))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if number == len(lines):  # no newline after it: the write was cut short, its answer never left
                log.info("journal: %s ends in a record cut short by the stop; skipped", path)
                continue
            readable = False
            log.error("journal: %s:%d does not parse (%s); skipped, the segment is kept as %s.unreadable",
                      path, number, exc, path.name)  # fmt: skip
            continue
        if isinstance(record, Episode):
            episodes.setdefault(record.episode_id, record)
        else:
            calls[record.call_id] = record
    return readable


def _insert(store: Store, insert, records: list, kind: str) -> None:
    """All at once; if that fails, one by one, spilling the ones DuckDB refuses (the Recorder's spill file)."""
    if not records:
        return
    try:
        insert(records)
        return
    except Exception as exc:
        log.warning("journal replay: writing %d %ss failed (%s); writing them one by one", len(records), kind, exc)
    spill_path = store.path.with_name(store.path.name + ".spill.jsonl")
    for record in records:
        try:
            insert([record])
        except Exception as exc:
            log.error("journal replay: %s %s could not be written (%s); spilling it to %s", kind,
                      getattr(record, "call_id", None) or record.episode_id, exc, spill_path)  # fmt: skip
            line = encode_record(kind, record, error=f"{type(exc).__name__}: {exc}", spilled_at=time.time())
            with open(spill_path, "ab") as f:
                f.write(line)
