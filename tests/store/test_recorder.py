"""The Recorder, the proxy's single writer: batches, flushes, spills, and reads while it writes. Real DuckDB files.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import orjson

from harness.core.records import Episode
from harness.store.database import (
    ROW_GROUP_SIZE,
    Store,
)
from harness.store.recorder import Recorder, read_spill
from tests.store.support import count, make_call, wait_until

SCHEMA_DOC = Path(__file__).resolve().parents[2] / "docs" / "schema.md"

# --- the recorder -----------------------------------------------------------------------------------------


def test_recorder_writes_when_a_batch_is_full(store: Store):
    with Recorder(store, max_batch=4, max_write=4, max_delay_s=60) as recorder:
        for i in range(3):
            recorder.record_call(make_call(call_index=i, n_choices=1))
        time.sleep(0.3)
        assert count(store, "calls") == 0 and recorder.pending == 3
        recorder.record_call(make_call(call_index=3, n_choices=1))
        assert wait_until(lambda: count(store, "calls") == 4)
        assert wait_until(lambda: recorder.pending == 0) and recorder.calls_written == 4


def test_recorder_writes_once_the_oldest_record_waited_max_delay(store: Store):
    with Recorder(store, max_batch=1000, max_delay_s=0.05) as recorder:
        recorder.record_episode(Episode("ep-0", "run-1", time.time(), "url"))
        recorder.record_call(make_call())
        assert wait_until(lambda: count(store, "calls") == 1 and count(store, "episodes") == 1, timeout=3)


def test_flush_makes_everything_recorded_before_it_visible(store: Store):
    with Recorder(store, max_batch=1000, max_delay_s=60) as recorder:
        recorder.record_episode(Episode("ep-0", "run-1", time.time(), "url"))
        for i in range(5):
            recorder.record_call(make_call(call_index=i))
        recorder.flush(timeout=10)
        assert (count(store, "calls"), count(store, "choices"), count(store, "episodes")) == (5, 10, 1)
        assert recorder.pending == 0
        recorder.flush()  # nothing pending: returns at once


def test_close_writes_what_is_buffered_is_idempotent_and_spills_late_records(store: Store):
    recorder = Recorder(store, max_batch=1000, max_delay_s=60)
    for i in range(7):
        recorder.record_call(make_call(call_index=i, n_choices=1))
    recorder.close()
    recorder.close()
    assert count(store, "calls") == 7 and recorder.calls_written == 7 and recorder.pending == 0
    late = make_call(call_index=7)
    recorder.record_call(late)  # a shutdown race: not written, not lost either
    assert recorder.calls_spilled == 1 and read_spill(recorder.spill_path) == [late]


def test_a_failing_row_is_spilled_and_the_rest_of_its_batch_lands(store: Store):
    existing = make_call(call_index=0)
    store.add_calls([existing])
    refused = dataclasses.replace(make_call(call_index=9), role_key=None)  # NOT NULL
    batch = [make_call(call_index=i) for i in (1, 2, 3)] + [refused]
    batch += [make_call(call_index=i) for i in (4, 5)]
    with Recorder(store, max_batch=1000, max_delay_s=60) as recorder:
        for call in batch:
            recorder.record_call(call)
        recorder.flush()
        assert (recorder.calls_written, recorder.calls_spilled, recorder.records_lost) == (5, 1, 0)
        assert "ConstraintException" in recorder.last_error
    assert count(store, "calls") == 6
    assert store.query("SELECT call_index FROM calls WHERE call_id = ?", [existing.call_id]).rows == [(0,)]
    lines = (store.path.parent / "harness.duckdb.spill.jsonl").read_bytes().splitlines()
    assert len(lines) == 1 and "NOT NULL constraint failed" in orjson.loads(lines[0])["error"]
    assert read_spill(store.path.parent / "harness.duckdb.spill.jsonl") == [refused]


def test_queries_from_other_threads_run_while_the_recorder_writes(store: Store):
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                store.query("SELECT count(*), sum(len(prompt_ids)) FROM calls")
            except BaseException as e:  # noqa: BLE001 - collected for the assert below
                errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    with Recorder(store, max_batch=8, max_delay_s=0.01) as recorder:
        for i in range(64):
            recorder.record_call(make_call(call_index=i, n_choices=1, prompt_tokens=500))
    done.set()
    thread.join()
    assert not errors and count(store, "calls") == 64


def test_a_full_row_group_batch_lands_whole(store: Store):
    """Batches of ROW_GROUP_SIZE calls take DuckDB's direct-to-file path instead of the WAL: same rows."""
    calls = [make_call(f"ep-{i // 8}", i % 8, n_choices=1, prompt_tokens=32) for i in range(ROW_GROUP_SIZE + 5)]
    with Recorder(store, max_batch=ROW_GROUP_SIZE, max_delay_s=60) as recorder:
        for call in calls:
            recorder.record_call(call)
    store.checkpoint()
    sql = "SELECT count(*), sum(len(prompt_ids)), sum(list_sum(prompt_ids)) FROM calls"
    expected = (len(calls), 32 * len(calls), sum(sum(c.prompt_ids) for c in calls))
    assert store.query(sql).rows == [expected]
    assert count(store, "choices") == len(calls)
