"""The proxy's single writer: records are buffered in memory and written to the store in batches by a thread.

`record_call` and `record_episode` run on the proxy's event loop, so they only append to a list under a lock, after
one `os.write` of the record to the journal (harness/store/journal.py: ~10-50 us, what a killed process would
otherwise lose; the journal is replayed when the store is opened again). A daemon thread writes when `max_batch`
calls are waiting or the oldest record has waited `max_delay_s`, episodes before calls; under load one write takes
everything waiting, up to `max_write` calls, because each transaction has a fixed cost.

Nothing recorded is dropped: when a batch fails (a row DuckDB refuses, a disk error), it is split in halves and
retried until the failing records are isolated; those are appended to the spill file `<db path>.spill.jsonl`
with the error, and `read_spill` turns them back into records. A full disk is different: the batch stays in
memory and is tried again every `retry_s` until it lands, and `disk_full` says why meanwhile (the proxy refuses
new calls with it: they could not be recorded). Only if a record can be neither written nor spilled (the disk
still full at close) is it lost, and then it is counted in `records_lost` and logged (and stays in the journal,
for the next open to try again).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson

from harness.core.records import Call, Episode
from harness.store.database import ROW_GROUP_SIZE, Store
from harness.store.journal import Journal, decode_record, encode_record

__all__ = ["Recorder", "read_spill"]

log = logging.getLogger(__name__)


class Recorder:
    """Batches calls and episodes into a Store on a background thread. Start it, record, then close()."""

    def __init__(
        self,
        store: Store,
        *,
        max_batch: int = 256,
        max_delay_s: float = 0.2,
        max_write: int | None = None,
        spill_path: str | Path | None = None,
        journal: bool = True,
    ) -> None:
        """max_write defaults to max(max_batch, ROW_GROUP_SIZE): a full row group skips the WAL. `journal`: off,
        a killed process loses what is buffered (for benchmarks that measure what the journal costs)."""
        max_write = max_write or max(max_batch, ROW_GROUP_SIZE)
        if max_batch < 1 or max_write < max_batch or max_delay_s < 0:
            raise ValueError(f"need 1 <= max_batch <= max_write and max_delay_s >= 0, got {max_batch=} "
                             f"{max_write=} {max_delay_s=}")  # fmt: skip
        self.store = store
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.max_write = max_write
        self.spill_path = Path(spill_path or store.path.with_name(store.path.name + ".spill.jsonl"))

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the writer waits on it for records
        self._progress = threading.Condition(self._lock)  # flush() waits on it for writes
        self._calls: list[Call] = []
        self._episodes: list[Episode] = []
        self._oldest: float | None = None  # monotonic time the oldest buffered record arrived
        self._urgent = False  # a flush() is waiting: write now
        self._closing = False
        self._journal = Journal(store.path) if journal else None
        self._early: dict[str, bytes] = {}  # call_id -> journaled early record (journal_call) awaiting record_call
        self._recorded = [0, 0]  # episodes, calls ever recorded
        self._done = [0, 0]  # episodes, calls written or spilled

        self.calls_written = 0
        self.calls_spilled = 0
        self.episodes_written = 0
        self.episodes_spilled = 0
        self.records_lost = 0  # failed to insert AND failed to spill (see the log)
        self.last_error: str | None = None
        self.disk_full: str | None = None  # why the last write found no space; None once a write lands
        self.retry_s = 1.0  # how often a write held back by a full disk is tried again

        self._thread = threading.Thread(target=self._run, name="harness-recorder", daemon=True)
        self._thread.start()

    # --- called from the event loop: append only ---------------------------------------------------------

    def record_call(self, call: Call) -> None:
        line = encode_record("call", call) if self._journal is not None else b""
        with self._lock:
            if self._append(self._calls, call, 1, line):
                if len(self._calls) == self.max_batch:
                    self._work.notify()
                return
        self._spill_late(call, "call")

    def record_episode(self, episode: Episode) -> None:
        line = encode_record("episode", episode) if self._journal is not None else b""
        with self._lock:
            if self._append(self._episodes, episode, 0, line):
                return
        self._spill_late(episode, "episode")

    def journal_call(self, call: Call) -> None:
        """Journal a call whose answer is complete, before its last bytes go out (a stream's [DONE]); the call's
        `record_call` follows once they have, and replaces it. A crash in between replays this one."""
        if self._journal is None:
            return
        line = encode_record("call", call)
        with self._lock:
            if not self._closing:
                self._journal.append(line)
                self._early[call.call_id] = line

    def _append(self, buffer: list, record: Call | Episode, kind: int, line: bytes) -> bool:
        if self._closing:
            return False
        if self._journal is not None:
            self._journal.append(line)  # under the lock: into the segment that the batch taking `record` seals
            if kind == 1 and self._early:
                self._early.pop(record.call_id, None)
        buffer.append(record)
        self._recorded[kind] += 1
        if self._oldest is None:
            self._oldest = time.monotonic()
            self._work.notify()  # start the writer's max_delay_s clock
        return True

    def _spill_late(self, record: Call | Episode, kind: str) -> None:
        """A record that arrives after close() (a shutdown race) is not dropped: it goes to the spill file."""
        error = RuntimeError(f"recorded after the recorder for {self.store.path} was closed")
        self._spill(record, kind, error)
        with self._lock:  # the writer may still be counting
            if kind == "call":
                self.calls_spilled += 1
            else:
                self.episodes_spilled += 1

    @property
    def pending(self) -> int:
        """Records recorded but not yet written or spilled (buffered or being written)."""
        with self._lock:
            return sum(self._recorded) - sum(self._done)

    # --- called from other threads -------------------------------------------------------------------------

    def mark(self) -> tuple[int, int]:
        """A point in the record stream: `flush(upto=mark)` waits for what was recorded before it."""
        with self._lock:
            return self._recorded[0], self._recorded[1]

    def flush(self, timeout: float = 30, *, upto: tuple[int, int] | None = None) -> None:
        """Block until everything recorded before this call (or before `upto`, a `mark()`) is in the database
        (or the spill file)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = list(upto or self._recorded)
            if self._done[0] >= target[0] and self._done[1] >= target[1]:
                return
            self._urgent = True
            self._work.notify()
            while self._done[0] < target[0] or self._done[1] < target[1]:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    pending = sum(target) - sum(self._done)
                    raise TimeoutError(
                        f"recorder flush to {self.store.path} gave up after {timeout}s or a dead writer thread "
                        f"(alive: {self._thread.is_alive()}): {pending} records still pending "
                        f"(last error: {self.last_error})"
                    )
                self._progress.wait(remaining)

    def close(self) -> None:
        """Write everything still buffered, then stop the writer thread, and delete the journal (unless a record
        could be neither written nor spilled: then the next open replays it). Safe to call twice."""
        with self._lock:
            self._closing = True
            self._work.notify()
        self._thread.join()
        if self._journal is not None:
            with self._lock:
                keep = bool(self._early) or self.records_lost > 0
                self._journal.remove(self._journal.close(keep=keep))

    @property
    def journal_failures(self) -> int:
        """Records that could not be journaled (a full disk): a crash before they are written loses them."""
        return self._journal.failures if self._journal is not None else 0

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the writer thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._wait_for_batch():
                    return
                episodes, self._episodes = self._episodes, []
                calls, self._calls = self._calls[: self.max_write], self._calls[self.max_write :]
                segments = []
                if not self._calls:
                    self._oldest, self._urgent = None, False
                    if self._journal is not None:  # every record journaled so far is in this batch
                        segments = self._journal.seal(self._early.values())
            held: tuple[list, list] = ([], [])
            lost = self.records_lost
            try:
                held = self._write(episodes, calls)
            except Exception:  # _write handles failures itself; this only keeps the thread alive
                log.exception("recorder: unexpected error writing %d calls", len(calls))
                self.records_lost += len(episodes) + len(calls)
            if segments and not (held[0] or held[1]) and self.records_lost == lost:
                self._journal.remove(segments)  # committed (or spilled): commit first, then delete
            with self._lock:
                if segments and (held[0] or held[1]):
                    self._journal.unseal(segments)
                # with records lost, their segments stay on disk for the next open to replay
                self._done[0] += len(episodes) - len(held[0])
                self._done[1] += len(calls) - len(held[1])
                self._progress.notify_all()
                if held[0] or held[1]:  # the disk is full: back in front of the queue, tried again in a while
                    self._episodes[:0], self._calls[:0] = held
                    self._oldest = self._oldest or time.monotonic()
                    self._work.wait(self.retry_s)

    def _wait_for_batch(self) -> bool:
        """With the lock held: wait until a write is due. False when closing and nothing is left."""
        while True:
            if not self._calls and not self._episodes:
                if self._closing:
                    return False
                self._work.wait()
                continue
            if self._closing or self._urgent or len(self._calls) >= self.max_batch:
                return True
            remaining = self._oldest + self.max_delay_s - time.monotonic()
            if remaining <= 0:
                return True
            self._work.wait(remaining)

    def _write(self, episodes: list[Episode], calls: list[Call]) -> tuple[list[Episode], list[Call]]:
        """Write a batch; returns what a full disk held back (nothing written yet), to be tried again."""
        held_episodes: list[Episode] = []
        if episodes:
            written, held_episodes = self._insert_isolating(self.store.add_episodes, episodes, "episode")
            with self._lock:
                self.episodes_written += written
                self.episodes_spilled += len(episodes) - written - len(held_episodes)
        if held_episodes:  # calls wait for their episodes
            return held_episodes, calls
        written, held_calls = self._insert_isolating(self.store.add_calls, calls, "call") if calls else (0, [])
        with self._lock:
            self.calls_written += written
            self.calls_spilled += len(calls) - written - len(held_calls)
        if not held_calls:
            self.disk_full = None
        return [], held_calls

    def _insert_isolating(self, insert: Callable[[Sequence], None], records: list, kind: str) -> tuple[int, list]:
        """Insert records: (how many were written, those a full disk held back). On any other failure, split in
        halves until each failing record is alone, and spill those."""
        try:
            insert(records)
            return len(records), []
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            if _is_disk_full(e) and not self._closing:
                if not self.disk_full:
                    log.error("recorder: no space left to write to %s (%s); holding %d %ss in memory and trying "
                              "again every %gs", self.store.path, e, len(records), kind, self.retry_s)  # fmt: skip
                self.disk_full = self.last_error
                return 0, records
            if len(records) == 1:
                self._spill(records[0], kind, e)
                return 0, []
            log.warning("recorder: writing %d %ss failed (%s); isolating the bad ones", len(records), kind, e)
        middle = len(records) // 2
        w1, h1 = self._insert_isolating(insert, records[:middle], kind)
        w2, h2 = self._insert_isolating(insert, records[middle:], kind)
        return w1 + w2, h1 + h2

    def _spill(self, record: Call | Episode, kind: str, error: Exception) -> None:
        log.error("recorder: %s %s could not be written (%s); spilling it to %s",
                  kind, _record_id(record), error, self.spill_path)  # fmt: skip
        try:
            data = encode_record(kind, record, error=f"{type(error).__name__}: {error}", spilled_at=time.time())
            with open(self.spill_path, "ab") as f:
                f.write(data)
        except Exception:
            self.records_lost += 1
            log.exception("recorder: LOST %s %s: it could not be spilled to %s",
                          kind, _record_id(record), self.spill_path)  # fmt: skip


def _is_disk_full(error: Exception) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(text in str(error) for text in ("No space left on device", "Disk quota exceeded"))


def read_spill(path: str | Path) -> list[Call | Episode]:
    """The records in a spill file, in order, ready to be inserted again once the cause is fixed."""
    records: list[Call | Episode] = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(decode_record(orjson.loads(line)))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    return records


def _record_id(record: Call | Episode) -> str:
    return getattr(record, "call_id", None) or getattr(record, "episode_id", "?")
