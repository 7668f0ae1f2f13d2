"""How fast the recorder gets calls into DuckDB, against a naive per-row INSERT, in one run.

Each call looks like an agent turn late in an episode: a 2k-token prompt (engine ids plus an ~8 kB JSON
request whose text is unique per call), one ~200-token completion with float logprobs, a ~1 kB JSON response.
The recorder path is end to end: `record_call` N times, then `close()` (everything committed), wall time.
The baseline inserts fewer calls one row per statement, as a first implementation would.
Goal (from the issue): >= 5,000 calls/s through the recorder.

    python bench/recorder_ingest.py [--n 20000] [--baseline-n 300] [--repeat 3] [--no-docs]

Writes its section of docs/BENCHMARKS.md (between the recorder_ingest markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path

import duckdb
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.docs_section import DOCS, write_section  # noqa: E402
from harness.core.records import ENGINE, OK, Call, Choice  # noqa: E402
from harness.store.database import Store  # noqa: E402
from harness.store.recorder import Recorder  # noqa: E402

PROMPT_TOKENS = 2000
COMPLETION_TOKENS = 200
VOCAB = 151_000


def make_calls(n: int, seed: int = 0) -> list[Call]:
    """n realistic calls. Token id lists come from a pool (conversion cost does not depend on sharing them);
    request text is a unique slice of a random-word corpus, so compression sees text, not repeats."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]
    corpus = " ".join(rng.choices(words, k=2_000_000))
    pool = [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
    completions = [[rng.randrange(VOCAB) for _ in range(COMPLETION_TOKENS)] for _ in range(64)]
    logprobs = [[-rng.expovariate(2.0) for _ in range(COMPLETION_TOKENS)] for _ in range(64)]
    calls = []
    for i in range(n):
        start = rng.randrange(len(corpus) - 9000)
        prompt, answer = corpus[start : start + 8000], corpus[start + 8000 : start + 8800]
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": prompt}]
        request = {"model": "policy", "messages": messages, "logprobs": True}
        message = {"role": "assistant", "content": answer}
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS}
        response = {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": "policy", "usage": usage,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
        calls.append(
            Call(
                call_id=uuid.uuid4().hex, run_id="bench", episode_id=f"ep-{i // 8}", call_index=i % 8,
                endpoint="chat", stream=False, requested_model="gpt-4o-mini", served_model="policy",
                role_key="r0", system_hash="s0", tools_hash=None, request=orjson.dumps(request),
                response=orjson.dumps(response), prompt_ids=pool[i % 64],
                choices=[Choice(0, completions[i % 64], logprobs[i % 64], "stop", answer)],
                token_source=ENGINE, status=OK, http_status=200, error=None, started_at=time.time(),
                latency_ms=850.0, ttft_ms=None, weight_version=3, prompt_tokens=PROMPT_TOKENS,
                completion_tokens=COMPLETION_TOKENS,
            )  # fmt: skip
        )
    return calls


def bench_recorder(calls: list[Call], path: Path) -> dict:
    store = Store.open(path)
    recorder = Recorder(store)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for call in calls:
        recorder.record_call(call)
    t_recorded = time.perf_counter()
    recorder.close()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert recorder.calls_written == len(calls), (recorder.calls_written, recorder.last_error)
    store.checkpoint()
    store.close()
    return {
        "calls_per_s": len(calls) / wall,
        "cpu_us_per_call": cpu / len(calls) * 1e6,
        "record_call_us": (t_recorded - t0) / len(calls) * 1e6,
        "bytes_per_call": path.stat().st_size / len(calls),
    }


def bench_per_row_insert(calls: list[Call], path: Path) -> dict:
    """The naive way: one INSERT per call and per choice, lists passed as Python parameters."""
    store = Store.open(path)
    cur = store.cursor()
    t0 = time.perf_counter()
    marks = ", ".join(["?"] * 18 + ["to_timestamp(?)::TIMESTAMP"] + ["?"] * 6)
    for c in calls:
        cur.execute(
            f"INSERT INTO calls VALUES ({marks})",
            [c.call_id, c.run_id, c.episode_id, c.call_index, c.endpoint, c.stream, c.requested_model,
             c.served_model, c.role_key, c.system_hash, c.tools_hash, c.request.decode(), c.response.decode(),
             c.prompt_ids, c.token_source, c.status, c.http_status, c.error, c.started_at, c.latency_ms,
             c.ttft_ms, c.weight_version, c.prompt_tokens, c.completion_tokens, _json_text(c.extra)],
        )  # fmt: skip
        for ch in c.choices:
            cur.execute(
                "INSERT INTO choices VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [c.call_id, ch.index, ch.completion_ids, ch.logprobs, ch.finish_reason, ch.text, None, None],
            )
    wall = time.perf_counter() - t0
    store.close()
    return {"calls_per_s": len(calls) / wall}


def _json_text(value: object) -> str:
    return orjson.dumps(value).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="calls through the recorder")
    parser.add_argument("--baseline-n", type=int, default=300, help="calls through per-row INSERT")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each path; the median is reported")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()

    print(f"building {args.n} calls ...", flush=True)
    calls = make_calls(args.n)
    load = os.getloadavg()[0]
    recorder_runs, baseline_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):  # interleaved, so both paths see the same machine
            baseline_calls, folder = calls[: args.baseline_n], Path(tmp)
            baseline_runs.append(bench_per_row_insert(baseline_calls, folder / f"baseline{i}.duckdb"))
            recorder_runs.append(bench_recorder(calls, folder / f"recorder{i}.duckdb"))
            print(f"run {i + 1}: recorder {recorder_runs[-1]['calls_per_s']:,.0f} calls/s, "
                  f"per-row INSERT {baseline_runs[-1]['calls_per_s']:,.0f} calls/s", flush=True)  # fmt: skip
    recorder = {key: statistics.median(r[key] for r in recorder_runs) for key in recorder_runs[0]}
    baseline = statistics.median(r["calls_per_s"] for r in baseline_runs)
    best = max(r["calls_per_s"] for r in recorder_runs)
    machine = f"{os.cpu_count()} CPUs, Python {platform.python_version()}, DuckDB {duckdb.__version__}"
    command = f"bench/recorder_ingest.py --n {args.n} --baseline-n {args.baseline_n} --repeat {args.repeat}"
    lines = [
        "## recorder_ingest",
        "",
        f"`python {command}` on {date.today()}: {machine}; 1-minute load average {load:.1f} at the start "
        "(other work on the machine slows both paths).",
        f"Calls of {PROMPT_TOKENS} prompt tokens (~8 kB JSON request) and {COMPLETION_TOKENS} completion "
        "tokens with logprobs. Goal: >= 5,000 calls/s through the recorder.",
        "",
        f"| path | calls | calls/s (median of {args.repeat}) | best |",
        "| --- | ---: | ---: | ---: |",
        f"| Recorder: record_call, then close (all committed) | {args.n} | {recorder['calls_per_s']:,.0f} "
        f"| {best:,.0f} |",
        f"| per-row INSERT baseline | {args.baseline_n} | {baseline:,.0f} "
        f"| {max(r['calls_per_s'] for r in baseline_runs):,.0f} |",
        "",
        f"- Recorder / per-row INSERT: **{recorder['calls_per_s'] / baseline:.0f}x** (medians)",
        f"- record_call on the event loop: {recorder['record_call_us']:.2f} us per call",
        f"- process CPU time (all threads, DuckDB's included): {recorder['cpu_us_per_call']:.0f} us per call, "
        "which a busy machine does not inflate the way it does wall time",
        f"- on disk after CHECKPOINT: {recorder['bytes_per_call'] / 1024:.1f} KiB per call",
        "- Where the time goes (profiled): records -> Arrow ~50 us/call (token ids packed with struct.pack, "
        "2.5x faster than pa.array), DuckDB insert + commit ~130 us/call. Batches of a full row group "
        "(ROW_GROUP_SIZE = 2048) are written compressed straight to the file instead of WAL + checkpoint: "
        "~2x; zstd on the request/response columns: 3x cheaper checkpoints than DuckDB's automatic choice.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        write_section("recorder_ingest", text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
