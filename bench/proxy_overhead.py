"""What the recording proxy costs an LLM call: direct to the engine, through a byte relay, and through the proxy
on uvloop (what `harness serve`, `harness run` and the trainer run when uvloop is installed, as the core's
requirements install it on Linux and macOS) and on asyncio (HARNESS_EVENT_LOOP=asyncio), all side by side in one
run.

Pinning: every hop (the proxies, the relay) alone on core 0, each in its own process (its event loop, recorder
thread and DuckDB share that one core); the scripted engine and the load generator on core 1, each in its own
process. The engine is `proxy.scripted_engine.ScriptedEngine` on uvloop, answering chat calls with 512 prompt ids and 32
completion tokens with logprobs. Recording is on, into DuckDB files in a temp dir.

Direct requests carry the body the proxy itself sends upstream (built with `proxy.request.prepare`), so the engine
does the same work on every path. The byte relay copies bytes and parses nothing: the floor that any extra process
hop pays on this pinning (the direct path's client and engine share core 1; a hop adds four cross-core wake-ups).
The load generator is a minimal keep-alive HTTP/1.1 client on asyncio.Protocol (uvloop): an aiohttp client would
spend more CPU a call than the engine, on the engine's core. CPU time of every process, and of the machine, is
sampled during each measurement, so the report says which core was the limit and what a co-tenant took.

  1. c=1 non-stream latency: blocks of requests rotating over the paths, a pause after each block so one proxy's
     batch write does not land in another path's block; plus an asyncio proxy that writes only at shutdown, to
     show what the batch writes cost.
  2. c=64 throughput: windows rotating over the paths; afterwards the proxies are stopped (they flush) and the
     rows in `calls` are counted against the calls answered.
  3. streams: time to first content chunk at c=1 (engine 2 ms between tokens), a 32-chunk stream arriving all at
     once at c=1, and inter-chunk gaps at c=50 (engine 20 ms between tokens).
Then an asyncio proxy once more under c=64 with cProfile (CPU time of its loop thread); the top is printed.

With `--before PATH` (a checkout of an earlier commit: `git worktree add /tmp/before c31202a`), that commit's
proxy (asyncio, as `harness serve` ran it then) takes part in phases 1 and 2 beside this tree's, in its own process
on the same core, and a second table sets the two side by side.

    .venv/bin/python bench/proxy_overhead.py [--quick] [--no-docs] [--before PATH]

Writes its section of docs/BENCHMARKS.md (between the proxy_overhead markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import duckdb
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.docs_section import DOCS, write_section  # noqa: E402
from bench.hops import (  # noqa: E402
    COMPLETION_TOKENS,
    LOAD_CORE,
    PROXY_CORE,
    SERVED_MODEL,
    Child,
    CoTenant,
    engine_main,
    pin,
    profile_shares,
    proxy_main,
    relay_main,
    streams,
    throughput,
    wait_quiet,
)
from bench.loadgen import client_blocks, client_load  # noqa: E402
from bench.proxy_overhead_parts import BEFORE, LOOPS, PROXIES, QUICK, Settings, answered, report, revision  # noqa: E402
from proxy import ProxyConfig  # noqa: E402
from proxy.request import CHAT, prepare  # noqa: E402


def chat_body(stream: bool) -> bytes:
    """What an agent sends: a system prompt and a ~2 kB user turn (about 512 tokens), no logprobs asked."""
    user = " ".join(f"word{i % 97}" for i in range(300))
    body = {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "You are a careful agent."},
                                                 {"role": "user", "content": user}],
            "max_tokens": COMPLETION_TOKENS, "temperature": 1.0}  # fmt: skip
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def request_bytes(url: str, body: bytes) -> bytes:
    parts = urlsplit(url + "/v1/chat/completions")
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer sk-bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


def requests_for(engine_url: str, stream: bool, **hop_urls: str) -> dict[str, bytes]:
    """To each hop the agent's request; to the engine ("direct") the body the proxy would send it."""
    agent = chat_body(stream)
    upstream = orjson.dumps(prepare(CHAT, orjson.loads(agent), ProxyConfig(upstream_url=engine_url), SERVED_MODEL).body)
    return {"direct": request_bytes(engine_url, upstream)} | {
        name: request_bytes(url, agent) for name, url in hop_urls.items()
    }


def count_rows(db_path: Path) -> tuple[int, int]:
    """(calls, calls with status ok) in a stopped proxy's database."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return con.execute("SELECT count(*), count(*) FILTER (status = 'ok') FROM calls").fetchone()
    finally:
        con.close()


def measure(pool, engine: Child, relay: Child, proxies: dict[str, Child], s: Settings) -> dict:
    """Every phase, each path side by side; `r[phase][path]` is what the load generator saw."""
    e, rl = engine.served, relay.served
    via = {name: child.served for name, child in proxies.items()}
    r = {"cotenant": {}, "waited": {}}

    def phase(name: str, label: str, fn) -> None:
        print(f"{label} ...", flush=True)
        t0 = time.perf_counter()
        wait_quiet(s.quiet_wait_s)
        r["waited"][name] = time.perf_counter() - t0
        meter = CoTenant()
        r[name] = fn()
        r["cotenant"][name] = meter.cores()

    def hops(engine_name: str, relay_too: bool) -> dict[str, str]:
        out = {"relay": rl[engine_name]} if relay_too else {}
        return out | {loop: via[f"{loop}-{engine_name}"] for loop in LOOPS}

    before = {BEFORE: via[BEFORE]} if BEFORE in via else {}
    reqs = requests_for(e["fast"], False, **hops("fast", True), deferred=via["deferred"], **before)
    phase(
        "lat",
        f"c=1 latency, {s.latency_n} requests per path",
        lambda: pool.apply(client_blocks, (reqs, s.latency_n, s.block, s.warmup_n, s.settle_s, False)),
    )
    reqs_ttft = requests_for(e["trickle"], True, **hops("trickle", True))
    phase(
        "ttft",
        f"c=1 time to first token, {s.ttft_n} streams per path",
        lambda: pool.apply(client_blocks, (reqs_ttft, s.ttft_n, s.block, s.warmup_n, s.settle_s, True)),
    )
    reqs_burst = requests_for(e["fast"], True, **hops("fast", False))
    phase(
        "burst",
        f"c=1 32-chunk streams, {s.burst_n} per path",
        lambda: pool.apply(client_blocks, (reqs_burst, s.burst_n, s.block, s.warmup_n, s.settle_s, True)),
    )
    reqs_load = requests_for(e["fast"], False, **hops("fast", True), **before)
    load_hops = {"relay": relay} | {loop: proxies[f"{loop}-fast"] for loop in LOOPS} | {
        name: proxies[name] for name in before}
    phase(
        "tput",
        f"c={s.concurrency} throughput, {s.rounds} x {s.window_s:g} s per path",
        lambda: throughput(pool, reqs_load, load_hops, engine, s),
    )
    reqs_paced = requests_for(e["paced"], True, **hops("paced", False))
    phase("streams", f"c={s.stream_concurrency} paced streams", lambda: streams(pool, reqs_paced, proxies, s))
    return r


def profile(pool, engine: Child, tmp: Path, s: Settings) -> tuple[str, float, dict[str, float]]:
    """An asyncio proxy under c=64 with cProfile on its loop thread (thread CPU time): top 15 own and cumulative."""
    fast_url = engine.served["fast"]
    stats_path = tmp / "proxy.prof"
    proxy = Child(proxy_main, PROXY_CORE, fast_url, str(tmp / "profile.duckdb"), "asyncio", {}, str(stats_path))
    try:
        proxy.ready()
        raw = requests_for(fast_url, False, proxy=proxy.served)["proxy"]
        pending = pool.apply_async(client_load, (raw, s.concurrency, s.warmup_s, s.profile_s))
        time.sleep(s.warmup_s)
        os.kill(proxy.process.pid, signal.SIGUSR1)
        time.sleep(s.profile_s)
        os.kill(proxy.process.pid, signal.SIGUSR2)
        rate = pending.get()["calls_per_s"]
        for _ in range(100):
            if stats_path.exists() and stats_path.stat().st_size:
                break
            time.sleep(0.1)
    finally:
        proxy.stop()
    text = io.StringIO()
    stats = pstats.Stats(str(stats_path), stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(15)
    return text.getvalue(), rate, profile_shares(stats)


# ---------------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (under a minute)")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    parser.add_argument("--before", metavar="PATH", help="a checkout of an earlier commit: its proxy runs beside "
                        "this tree's (asyncio) in the c=1 latency and c=64 throughput phases")
    args = parser.parse_args()
    s = QUICK if args.quick else Settings()
    if len(os.sched_getaffinity(0)) < 2:
        print("warning: fewer than 2 cores; every process shares one, so no number here isolates the proxy",
              file=sys.stderr)  # fmt: skip
    pin(LOAD_CORE)  # this process mostly sleeps; keep it off the hops' core
    children: list[Child] = []
    pool = None
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            engine = Child(engine_main, LOAD_CORE).ready()
            children.append(engine)
            relay = Child(relay_main, PROXY_CORE, engine.served)
            children.append(relay)
            proxies = {}
            for name, (loop, upstream, overrides) in PROXIES.items():
                db = str(tmp / f"{name}.duckdb")
                proxies[name] = Child(proxy_main, PROXY_CORE, engine.served[upstream], db, loop, overrides, None)
                children.append(proxies[name])
            if args.before:
                proxies[BEFORE] = Child(proxy_main, PROXY_CORE, engine.served["fast"], str(tmp / f"{BEFORE}.duckdb"),
                                        "asyncio", {}, None, str(Path(args.before).resolve()))
                children.append(proxies[BEFORE])
            for child in children:
                child.ready()
            pool = multiprocessing.get_context("spawn").Pool(1, initializer=pin, initargs=(LOAD_CORE,))
            results = measure(pool, engine, relay, proxies, s)
            for child in proxies.values():
                child.stop()  # the proxies flush on SIGTERM; only then can their databases be opened
            counts = {name: count_rows(tmp / f"{name}.duckdb") for name in proxies}
            served = answered(results)
            recorded = {name: (*counts[name], served[name]) for name in proxies}  # (rows, ok rows, answered)
            print("asyncio proxy under cProfile ...", flush=True)
            prof_text, prof_rate, prof_shares = profile(pool, engine, tmp, s)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            for child in reversed(children):
                child.stop()
    text = report(results, recorded, s, args.quick, prof_rate, prof_shares,
                  revision(args.before) if args.before else None)
    print(text)
    print("\ncProfile of the proxy's loop thread under load (CPU time):\n" + prof_text)
    if not args.no_docs:
        write_section("proxy_overhead", text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
