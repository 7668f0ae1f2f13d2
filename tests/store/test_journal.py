"""The recorder's journal (harness/store/journal.py): what a killed process had recorded but not written is written
in by the next opening of the file, once, and the journal is gone afterwards."""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson

from harness.core.records import FINISHED, Episode
from harness.store.database import Store
from harness.store.journal import decode_record, encode_record, journal_segments, pending_records
from harness.store.recorder import Recorder
from tests.store.support import make_call

ROOT = Path(__file__).resolve().parents[2]


def _killed_after(code: str, db: Path) -> None:
    """Run `code` in a child process (`db`, `Store`, `Recorder`, `make_call` at hand), SIGKILL it once it prints
    "ready"."""
    prelude = ("import sys, time\nfrom pathlib import Path\nfrom harness.store.database import Store\n"
               "from harness.store.recorder import Recorder\nfrom tests.store.support import make_call\n"
               f"db = Path({str(db)!r})\n")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)


def _call_ids(db: Path) -> list[str]:
    with Store.open(db, read_only=True) as store:
        return [row[0] for row in store.query("SELECT call_id FROM calls ORDER BY call_index").rows]


def test_calls_a_killed_recorder_held_in_memory_are_written_at_the_next_open(tmp_path):
    db = tmp_path / "harness.duckdb"
    _killed_after(
        """
        store = Store.open(db)
        recorder = Recorder(store, max_delay_s=600)  # nothing is written before the kill
        for i in range(20):
            recorder.record_call(make_call("ep-killed", i, call_id=f"call-{i:02d}", n_choices=1, prompt_tokens=50))
        print("ready", flush=True)
        time.sleep(600)
    """,
        db,
    )
    assert pending_records(db) == 20
    with Store.open(db) as store:  # the proxy's restart
        assert store.query("SELECT count(*) FROM calls").rows == [(20,)]
        assert store.query("SELECT count(*) FROM choices").rows == [(20,)]
    assert journal_segments(db) == []


def test_a_written_batch_clears_the_journal_and_close_leaves_none(store: Store):
    with Recorder(store, max_delay_s=600) as recorder:
        recorder.record_episode(Episode("ep-1", "run-1", time.time(), "url"))
        recorder.record_call(make_call("ep-1", 0, n_choices=1, prompt_tokens=50))
        assert pending_records(store.path) == 2
        recorder.flush()
        assert journal_segments(store.path) == []  # committed, then deleted
        recorder.record_call(make_call("ep-1", 1, n_choices=1, prompt_tokens=50))
        assert pending_records(store.path) == 1
    assert journal_segments(store.path) == []
    assert store.query("SELECT count(*) FROM calls").rows == [(2,)]


def test_replay_skips_calls_the_file_has_keeps_the_later_record_and_a_cut_short_line(tmp_path):
    db = tmp_path / "harness.duckdb"
    written = make_call("ep-1", 0)
    early, final = make_call("ep-1", 1, call_id="c1", status="error"), make_call("ep-1", 1, call_id="c1")
    with Store.open(db) as store:
        store.add_calls([written])
    episode = Episode("ep-1", "run-1", time.time(), "url")
    segment = db.with_name(db.name + ".journal.1")
    lines = [encode_record("episode", episode), encode_record("call", written), encode_record("call", early)]
    segment.write_bytes(b"".join(lines))
    later = encode_record("call", final)
    db.with_name(db.name + ".journal.2").write_bytes(later + later[: len(later) // 2])  # the kill cut the last short
    with Store.open(db) as store:
        rows = store.query("SELECT call_id, status FROM calls ORDER BY call_index").rows
        assert rows == [(written.call_id, "ok"), (final.call_id, "ok")]  # once each; the final record of call 1
        assert store.query("SELECT episode_id FROM episodes").rows == [("ep-1",)]
    assert journal_segments(db) == [] and not list(tmp_path.glob("*.unreadable"))


def test_a_journaled_call_keeps_its_role_and_policy_through_replay(tmp_path):
    db = tmp_path / "harness.duckdb"
    served = dataclasses.replace(make_call("ep-1", 0, n_choices=1, prompt_tokens=50), role="planner", policy="planner")
    frozen = dataclasses.replace(make_call("ep-1", 1, n_choices=1, prompt_tokens=50), role="critic")
    assert decode_record(orjson.loads(encode_record("call", served))) == served
    db.with_name(db.name + ".journal.1").write_bytes(encode_record("call", served) + encode_record("call", frozen))
    with Store.open(db) as store:
        assert store.query("SELECT role, policy FROM calls ORDER BY call_index").rows == [("planner", "planner"),
                                                                                           ("critic", None)]
    old = orjson.loads(encode_record("call", served))  # a journal a harness wrote before the two fields
    del old["record"]["role"], old["record"]["policy"]
    decoded = decode_record(old)
    assert (decoded.role, decoded.policy) == (None, None)


def test_an_unreadable_line_keeps_its_segment_and_the_rest_is_written(tmp_path, caplog):
    db = tmp_path / "harness.duckdb"
    calls = [make_call("ep-1", i, n_choices=1, prompt_tokens=50) for i in range(2)]
    segment = db.with_name(db.name + ".journal.3")
    segment.write_bytes(encode_record("call", calls[0]) + b"\0" * 100 + b"\n" + encode_record("call", calls[1]))
    with caplog.at_level(logging.ERROR), Store.open(db) as store:
        assert store.query("SELECT count(*) FROM calls").rows == [(2,)]
    assert "does not parse" in caplog.text
    assert [p.name for p in tmp_path.glob("*.journal.*")] == ["harness.duckdb.journal.3.unreadable"]


def test_a_read_only_open_writes_the_journal_in_first(tmp_path):
    db = tmp_path / "harness.duckdb"
    Store.open(db).close()
    call = make_call("ep-1", 0, n_choices=1, prompt_tokens=50)
    db.with_name(db.name + ".journal.1").write_bytes(encode_record("call", call))
    assert _call_ids(db) == [call.call_id]  # `harness sql` on the closed file
    assert journal_segments(db) == []


def test_a_read_only_open_that_cannot_write_says_what_it_does_not_show(tmp_path, caplog):
    db = tmp_path / "harness.duckdb"
    Store.open(db).close()
    db.with_name(db.name + ".journal.1").write_bytes(encode_record("call", make_call(n_choices=1)))
    reader = subprocess.Popen(  # another reader holds the file: no read-write open for now
        [sys.executable, "-c", f"import duckdb, sys, time; c = duckdb.connect({str(db)!r}, read_only=True); "
         "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert reader.stdout.readline().strip() == "ready"
        with caplog.at_level(logging.WARNING), Store.open(db, read_only=True) as store:
            assert store.query("SELECT count(*) FROM calls").rows == [(0,)]
    finally:
        reader.kill()
        reader.wait(30)
    assert "its journal holds 1 records" in caplog.text and "harness serve --db" in caplog.text
    assert pending_records(db) == 1


def test_a_stream_journaled_before_its_last_bytes_is_replaced_by_its_record(store: Store):
    early, final = make_call("ep-1", 0, call_id="c1", status="error"), make_call("ep-1", 0, call_id="c1")
    with Recorder(store, max_delay_s=600) as recorder:
        recorder.record_call(make_call("ep-0", 0, call_id="c0"))
        recorder.journal_call(early)
        recorder.flush()  # writes c0 and deletes its journal: c1's early record is carried over
        assert pending_records(store.path) == 1
        recorder.record_call(final)
    assert journal_segments(store.path) == []
    assert store.query("SELECT call_id, status FROM calls ORDER BY call_id").rows == [("c0", "ok"), ("c1", "ok")]


def test_an_outcome_is_in_the_file_once_add_outcome_returns(tmp_path):
    """`harness run` writes each outcome straight to DuckDB (a commit) before it reports it: a kill keeps it."""
    db = tmp_path / "harness.duckdb"
    _killed_after(
        """
        from harness.core.records import EpisodeOutcome
        store = Store.open(db)
        store.start_run("run-1", {}, "test")
        store.add_outcome(EpisodeOutcome("ep-1", "run-1", "t1", 0, 1, "finished", 0, "42", None, time.time(), 5.0,
                                         None))
        print("ready", flush=True)
        time.sleep(600)
    """,
        db,
    )
    with Store.open(db, read_only=True) as store:
        assert store.query("SELECT episode_id, status, answer FROM episode_outcomes").rows == [("ep-1", FINISHED, "42")]
