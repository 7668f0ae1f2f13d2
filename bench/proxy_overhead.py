"""What the recording proxy costs an LLM call: direct-to-engine and through-the-proxy, side by side in one run.

Three processes, pinned: the proxy alone on core 0 (its event loop, the recorder thread and DuckDB share that one
core); the scripted engine and the load generator on core 1, each in its own process. The engine is
`proxy.scripted.ScriptedEngine` answering at once with 512 prompt ids and 32 completion tokens with logprobs
(`chunk_delay_s=0.02` for the paced stream). Recording is on, into a DuckDB file in a temp dir.

Direct requests carry the body the proxy itself would send upstream (built with `proxy.capture.prepare`), so the
engine does the same work on both paths and the difference is the proxy hop. The load generator is a minimal
keep-alive HTTP/1.1 client on asyncio.Protocol (uvloop): an aiohttp client costs more CPU per call than the
engine, and it shares core 1 with the engine. Per-process CPU is sampled during every throughput window, so the
table says which core was the limit.

Measured for the proxy on the stdlib asyncio loop and on uvloop, then once more under cProfile (asyncio):
  1. added latency at concurrency 1, non-stream chat: requests alternate direct / proxy.
  2. throughput at concurrency 64: windows alternate direct / proxy; afterwards the proxy is stopped (it flushes)
     and the rows in `calls` are counted against the calls sent.
  3. streams: added time to first content chunk at c=1 (alternating), and inter-chunk gaps at c=50.

    .venv/bin/python bench/proxy_overhead.py [--quick] [--no-docs]

Writes its section of docs/BENCHMARKS.md (between the proxy_overhead markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import multiprocessing
import os
import platform
import pstats
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import duckdb
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proxy import ProxyConfig, serve_forever  # noqa: E402
from proxy.capture import CHAT, prepare  # noqa: E402
from proxy.scripted import Script, ScriptedEngine  # noqa: E402

try:
    import uvloop
except ImportError:  # the stdlib loop still gives every number but the uvloop column
    uvloop = None

PROXY_CORE, LOAD_CORE = 0, 1
PROMPT_TOKENS, COMPLETION_TOKENS, CHUNK_DELAY_S = 512, 32, 0.02
SERVED_MODEL = "scripted-model"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
START, END = "<!-- proxy_overhead:start -->", "<!-- proxy_overhead:end -->"


@dataclass(frozen=True)
class Settings:
    latency_n: int = 2000  # sequential requests per path at c=1 (non-stream)
    ttft_n: int = 1000  # sequential streams per path at c=1
    warmup_n: int = 200  # per path, before each c=1 series
    concurrency: int = 64
    rounds: int = 3  # throughput windows per path, alternating direct / proxy
    window_s: float = 4.0  # measured part of each window
    warmup_s: float = 0.5  # load before each window's measured part
    stream_concurrency: int = 50
    streams_per_client: int = 6  # paced streams (32 chunks, 20 ms apart) per concurrent client, per path
    profile_s: float = 4.0


QUICK = Settings(latency_n=400, ttft_n=200, warmup_n=50, rounds=1, window_s=2.0, streams_per_client=2,
                 profile_s=2.0)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Processes: pinning, loops, the engine, the proxy.
# ---------------------------------------------------------------------------------------------------------------


def _pin(core: int) -> None:
    """Pin every thread of this process (later threads inherit it) to one core."""
    if core not in os.sched_getaffinity(0) and len(os.sched_getaffinity(0)) < 2:
        return  # a one-core machine: nothing to separate
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})


def _run(coro, loop_kind: str = "uvloop"):
    factory = uvloop.new_event_loop if loop_kind == "uvloop" and uvloop else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _engine_main(conn, core: int) -> None:
    """Two scripted engines in one process: `fast` answers at once, `paced` sleeps 20 ms between stream chunks."""
    _pin(core)

    async def main():
        fast = ScriptedEngine(Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS))
        paced = ScriptedEngine(Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS,
                                      chunk_delay_s=CHUNK_DELAY_S))  # fmt: skip
        conn.send((await fast.start(), await paced.start()))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        while not stop.is_set():  # the scripted engine keeps every request body: forget them as we go
            fast.requests.clear()
            paced.requests.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        await fast.stop()
        await paced.stop()

    _run(main(), "uvloop")


def _proxy_main(conn, core: int, upstream: str, db_path: str, loop_kind: str, profile_path: str | None) -> None:
    """The proxy as `harness proxy` runs it (serve_forever); SIGUSR1/SIGUSR2 start/stop cProfile if asked."""
    _pin(core)
    config = ProxyConfig(upstream_url=upstream, db_path=Path(db_path), port=0, served_model=SERVED_MODEL)
    profiler = cProfile.Profile() if profile_path else None

    def stop_profile():
        profiler.disable()
        profiler.dump_stats(profile_path)

    def ready(server):
        if profiler is not None:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGUSR1, profiler.enable)
            loop.add_signal_handler(signal.SIGUSR2, stop_profile)
        conn.send(server.url)

    _run(serve_forever(config, on_ready=ready), loop_kind)


class Child:
    """A pinned child process that reports what it serves on a pipe; stopped with SIGTERM (the proxy flushes)."""

    def __init__(self, target, *args):
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        if not parent.poll(60):
            self.stop()
            raise RuntimeError(f"{target.__name__} did not come up within 60 s (exit code {self.process.exitcode})")
        self.served = parent.recv()
        self.ps = psutil.Process(self.process.pid)

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far: (main thread, all other threads)."""
        main = other = 0.0
        for t in self.ps.threads():
            if t.id == self.ps.pid:
                main += t.user_time + t.system_time
            else:
                other += t.user_time + t.system_time
        return main, other

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# ---------------------------------------------------------------------------------------------------------------
# The load generator: keep-alive HTTP/1.1 on asyncio.Protocol, Content-Length or chunked answers, SSE event times.
# ---------------------------------------------------------------------------------------------------------------


class Http(asyncio.Protocol):
    """One connection; `call(raw)` sends a prepared request and returns (status, body, [(t, sse event)])."""

    def __init__(self):
        self.transport = None
        self.buf = bytearray()
        self.done: asyncio.Future | None = None

    @classmethod
    async def open(cls, url: str) -> Http:
        parts = urlsplit(url)
        _, conn = await asyncio.get_running_loop().create_connection(cls, parts.hostname, parts.port)
        return conn

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection closed mid-answer: {exc}"))

    async def call(self, raw: bytes, stream: bool = False):
        self.status, self.length, self.chunked, self.body = 0, None, False, bytearray()
        self.events, self.sse = ([] if stream else None), bytearray()
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buf += data
        if self.status == 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            del self.buf[: end + 4]
            self.status = int(head[9:12])
            self.chunked = b"transfer-encoding: chunked" in head
            if not self.chunked:
                self.length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        if not self.chunked:
            if len(self.buf) >= self.length:
                self.body = bytes(self.buf[: self.length])
                del self.buf[: self.length]
                self.done.set_result((self.status, self.body, self.events))
            return
        while (eol := self.buf.find(b"\r\n")) >= 0:
            size = int(bytes(self.buf[:eol]).split(b";")[0], 16)
            if len(self.buf) < eol + 4 + size:
                return
            data = bytes(self.buf[eol + 2 : eol + 2 + size])
            del self.buf[: eol + 4 + size]
            if size == 0:
                self.done.set_result((self.status, bytes(self.body), self.events))
                return
            self.body += data
            if self.events is not None:
                self.sse += data
                while (k := self.sse.find(b"\n\n")) >= 0:
                    self.events.append((now, bytes(self.sse[:k])))
                    del self.sse[: k + 2]


def request_bytes(url: str, body: bytes) -> bytes:
    parts = urlsplit(url)
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer sk-bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


def content_times(events: list[tuple[float, bytes]]) -> list[float]:
    """Arrival times of the SSE events that carry answer text."""
    times = []
    for t, event in events:
        if not event.startswith(b"data: {"):
            continue
        choices = orjson.loads(event[6:]).get("choices") or ()
        if any((c.get("delta") or {}).get("content") for c in choices):
            times.append(t)
    return times


def client_alternating(targets: dict[str, bytes], n: int, warmup: int, stream: bool) -> dict:
    """c=1: one request per target in turn (order flipped every round); latency, and TTFT for streams."""

    async def main():
        conns = {name: await Http.open(urlsplit_host(raw)) for name, raw in targets.items()}
        out = {name: {"latency": [], "ttft": [], "errors": 0, "sent": 0} for name in targets}
        names = list(targets)
        for i in range(warmup + n):
            for name in names if i % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                status, _, events = await conns[name].call(targets[name], stream)
                t1 = time.perf_counter()
                r = out[name]
                r["sent"] += 1
                r["errors"] += status != 200
                if i >= warmup:
                    r["latency"].append(t1 - t0)
                    if stream:
                        r["ttft"].append(content_times(events)[0] - t0)
        for conn in conns.values():
            conn.transport.close()
        return out

    return _run(main())


def urlsplit_host(raw: bytes) -> str:
    """The base URL a prepared request goes to (its Host header)."""
    host = raw.split(b"\r\nHost: ", 1)[1].split(b"\r\n", 1)[0].decode()
    return f"http://{host}"


def client_load(raw: bytes, concurrency: int, warmup_s: float, window_s: float) -> dict:
    """`concurrency` connections in closed loops; counts answers completed inside the measured window."""

    async def main():
        conns = [await Http.open(urlsplit_host(raw)) for _ in range(concurrency)]
        t_start = time.perf_counter()
        t_measure, t_end = t_start + warmup_s, t_start + warmup_s + window_s
        out = {"latency": [], "errors": 0, "sent": 0, "in_window": 0}

        async def worker(conn):
            while (t0 := time.perf_counter()) < t_end:
                status, _, _ = await conn.call(raw)
                t1 = time.perf_counter()
                out["sent"] += 1
                out["errors"] += status != 200
                if t_measure <= t1 < t_end:
                    out["in_window"] += 1
                    out["latency"].append(t1 - t0)

        async def cpu_sampler():
            await asyncio.sleep(warmup_s)
            cpu0 = time.process_time()
            await asyncio.sleep(window_s)
            out["client_cpu"] = (time.process_time() - cpu0) / window_s

        await asyncio.gather(cpu_sampler(), *(worker(c) for c in conns))
        for conn in conns:
            conn.transport.close()
        out["calls_per_s"] = out["in_window"] / window_s
        return out

    return _run(main())


def client_streams(raw: bytes, concurrency: int, per_client: int) -> dict:
    """`concurrency` clients each reading `per_client` streams in a row; gaps between content chunks."""

    async def main():
        out = {"gaps": [], "ttft": [], "errors": 0, "sent": 0}

        async def worker():
            conn = await Http.open(urlsplit_host(raw))
            for _ in range(per_client):
                t0 = time.perf_counter()
                status, _, events = await conn.call(raw, stream=True)
                out["sent"] += 1
                out["errors"] += status != 200
                times = content_times(events)
                out["ttft"].append(times[0] - t0)
                out["gaps"].extend(b - a for a, b in zip(times, times[1:]))
            conn.transport.close()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out

    return _run(main())


# ---------------------------------------------------------------------------------------------------------------
# The measurements.
# ---------------------------------------------------------------------------------------------------------------


def chat_body(stream: bool) -> bytes:
    """What an agent sends: a system prompt and a ~2 kB user turn (about 512 tokens), no logprobs asked."""
    user = " ".join(f"word{i % 97}" for i in range(300))
    body = {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "You are a careful agent."},
                                                 {"role": "user", "content": user}],
            "max_tokens": COMPLETION_TOKENS, "temperature": 1.0}  # fmt: skip
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def requests_for(direct_url: str, proxy_url: str, stream: bool) -> dict[str, bytes]:
    """The agent's request to the proxy, and to the engine the body the proxy would send it."""
    agent = chat_body(stream)
    config = ProxyConfig(upstream_url=direct_url, served_model=SERVED_MODEL)
    upstream = prepare(CHAT, agent, config, SERVED_MODEL).upstream_body
    return {"direct": request_bytes(direct_url + "/v1/chat/completions", upstream),
            "proxy": request_bytes(proxy_url + "/v1/chat/completions", agent)}  # fmt: skip


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def throughput(pool, reqs: dict[str, bytes], proxy: Child, engine: Child, s: Settings) -> dict:
    """Alternating windows; CPU of the proxy (loop thread / other threads) and of the engine during each."""
    out = {name: {"calls_per_s": [], "latency": [], "errors": 0, "sent": 0, "client_cpu": [], "engine_cpu": [],
                  "proxy_loop_cpu": [], "proxy_other_cpu": []} for name in reqs}  # fmt: skip
    for _ in range(s.rounds):
        for name, raw in reqs.items():
            pending = pool.apply_async(client_load, (raw, s.concurrency, s.warmup_s, s.window_s))
            time.sleep(s.warmup_s + 0.1)
            t0, (p0, q0), e0 = time.perf_counter(), proxy.cpu(), sum(engine.cpu())
            time.sleep(s.window_s - 0.2)
            t1, (p1, q1), e1 = time.perf_counter(), proxy.cpu(), sum(engine.cpu())
            r, o = pending.get(), out[name]
            o["calls_per_s"].append(r["calls_per_s"])
            o["latency"] += r["latency"]
            o["errors"] += r["errors"]
            o["sent"] += r["sent"]
            o["client_cpu"].append(r["client_cpu"])
            o["engine_cpu"].append((e1 - e0) / (t1 - t0))
            o["proxy_loop_cpu"].append((p1 - p0) / (t1 - t0))
            o["proxy_other_cpu"].append((q1 - q0) / (t1 - t0))
    return out


def count_rows(db_path: Path) -> tuple[int, int]:
    """(calls, calls with status ok) in a stopped proxy's database."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return con.execute("SELECT count(*), count(*) FILTER (status = 'ok') FROM calls").fetchone()
    finally:
        con.close()


def measure(pool, engine: Child, loop_kind: str, tmp: Path, s: Settings) -> dict:
    """Every measurement for the proxy on one loop kind; both proxies are stopped and their rows counted."""
    fast_url, paced_url = engine.served
    fast_db, paced_db = tmp / f"{loop_kind}-fast.duckdb", tmp / f"{loop_kind}-paced.duckdb"
    fast = Child(_proxy_main, PROXY_CORE, fast_url, str(fast_db), loop_kind, None)
    paced = Child(_proxy_main, PROXY_CORE, paced_url, str(paced_db), loop_kind, None)
    try:
        print(f"[{loop_kind}] c=1 latency, {s.latency_n} requests per path ...", flush=True)
        lat = pool.apply(client_alternating, (requests_for(fast_url, fast.served, False), s.latency_n,
                                              s.warmup_n, False))  # fmt: skip
        print(f"[{loop_kind}] c=1 time to first token, {s.ttft_n} streams per path ...", flush=True)
        ttft = pool.apply(client_alternating, (requests_for(fast_url, fast.served, True), s.ttft_n, s.warmup_n,
                                               True))  # fmt: skip
        print(f"[{loop_kind}] c={s.concurrency} throughput, {s.rounds} x {s.window_s:g} s per path ...", flush=True)
        tput = throughput(pool, requests_for(fast_url, fast.served, False), fast, engine, s)
        print(f"[{loop_kind}] c={s.stream_concurrency} paced streams ...", flush=True)
        streams = {name: pool.apply(client_streams, (raw, s.stream_concurrency, s.streams_per_client))
                   for name, raw in requests_for(paced_url, paced.served, True).items()}  # fmt: skip
    finally:
        fast.stop()
        paced.stop()
    sent = {"fast": lat["proxy"]["sent"] + ttft["proxy"]["sent"] + tput["proxy"]["sent"],
            "paced": streams["proxy"]["sent"]}  # fmt: skip
    rows = {"fast": count_rows(fast_db), "paced": count_rows(paced_db)}
    return {"lat": lat, "ttft": ttft, "tput": tput, "streams": streams, "sent": sent, "rows": rows}


def profile(pool, engine: Child, tmp: Path, s: Settings) -> tuple[str, float]:
    """The asyncio proxy under c=64 load with cProfile on its loop thread: top functions, and calls/s meanwhile."""
    fast_url = engine.served[0]
    stats_path = tmp / "proxy.prof"
    proxy = Child(_proxy_main, PROXY_CORE, fast_url, str(tmp / "profile.duckdb"), "asyncio", str(stats_path))
    try:
        raw = requests_for(fast_url, proxy.served, False)["proxy"]
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
    stats = pstats.Stats(str(stats_path), stream=text)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(15)
    return text.getvalue(), rate


# ---------------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------------


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def ms(x: float) -> str:
    return f"{x * 1000:.3f}"


def met(ok: bool) -> str:
    return "**yes**" if ok else "**no**"


def rows_for(kind: str, r: dict, s: Settings) -> list[str]:
    """Table rows for one loop kind: | measurement | direct | proxy | added / ratio | goal | met |"""
    ld, lp = r["lat"]["direct"]["latency"], r["lat"]["proxy"]["latency"]
    add50, add99 = pct(lp, 0.5) - pct(ld, 0.5), pct(lp, 0.99) - pct(ld, 0.99)
    td, tp = r["ttft"]["direct"]["ttft"], r["ttft"]["proxy"]["ttft"]
    tt50, tt99 = pct(tp, 0.5) - pct(td, 0.5), pct(tp, 0.99) - pct(td, 0.99)
    cd, cp = mean(r["tput"]["direct"]["calls_per_s"]), mean(r["tput"]["proxy"]["calls_per_s"])
    rows_ok = r["rows"]["fast"][1] == r["sent"]["fast"] and r["rows"]["paced"][1] == r["sent"]["paced"]
    gd, gp = r["streams"]["direct"]["gaps"], r["streams"]["proxy"]["gaps"]
    g50, g99 = pct(gp, 0.5) / pct(gd, 0.5), pct(gp, 0.99) / pct(gd, 0.99)
    bunched = [sum(g < 0.002 for g in gaps) / len(gaps) for gaps in (gd, gp)]
    return [
        f"| {kind}: c=1 latency p50 (ms) | {ms(pct(ld, .5))} | {ms(pct(lp, .5))} | +{ms(add50)} | <= +0.6 | "
        f"{met(add50 <= 0.0006)} |",
        f"| {kind}: c=1 latency p99 (ms) | {ms(pct(ld, .99))} | {ms(pct(lp, .99))} | +{ms(add99)} | <= +2 | "
        f"{met(add99 <= 0.002)} |",
        f"| {kind}: c={s.concurrency} calls/s | {cd:,.0f} | {cp:,.0f} | {cp / cd:.2f}x | >= 3,000 recorded | "
        f"{met(cp >= 3000 and rows_ok)} |",
        f"| {kind}: c=1 stream TTFT p50 (ms) | {ms(pct(td, .5))} | {ms(pct(tp, .5))} | +{ms(tt50)} | <= +1 | "
        f"{met(tt50 <= 0.001)} |",
        f"| {kind}: c=1 stream TTFT p99 (ms) | {ms(pct(td, .99))} | {ms(pct(tp, .99))} | +{ms(tt99)} | - | - |",
        f"| {kind}: c={s.stream_concurrency} chunk gap p50 (ms) | {ms(pct(gd, .5))} | {ms(pct(gp, .5))} | "
        f"{g50:.3f}x | 0.9..1.1x | {met(0.9 <= g50 <= 1.1)} |",
        f"| {kind}: c={s.stream_concurrency} chunk gap p99 (ms) | {ms(pct(gd, .99))} | {ms(pct(gp, .99))} | "
        f"{g99:.3f}x | 0.9..1.1x | {met(0.9 <= g99 <= 1.1)} |",
        f"| {kind}: c={s.stream_concurrency} gaps < 2 ms (bunched) | {bunched[0]:.2%} | {bunched[1]:.2%} | - | "
        f"same as direct | {met(bunched[1] <= bunched[0] + 0.01)} |",
    ]


def limits_for(kind: str, r: dict, s: Settings) -> list[str]:
    """Where the c=64 time went: utilisation of each process, and the proxy's CPU per call."""
    td, tp = r["tput"]["direct"], r["tput"]["proxy"]
    cp = mean(tp["calls_per_s"])
    loop, other = mean(tp["proxy_loop_cpu"]), mean(tp["proxy_other_cpu"])
    lat = tp["latency"]
    return [
        f"- {kind}, c={s.concurrency}: direct {mean(td['calls_per_s']):,.0f}/s with core 1 at engine "
        f"{mean(td['engine_cpu']):.0%} + client {mean(td['client_cpu']):.0%}; through the proxy "
        f"{cp:,.0f}/s with core 0 at {loop + other:.0%} (loop thread {loop:.0%}, recorder + DuckDB threads "
        f"{other:.0%}) and core 1 at engine {mean(tp['engine_cpu']):.0%} + client {mean(tp['client_cpu']):.0%}.",
        f"  Proxy CPU per call {(loop + other) / cp * 1e6:.0f} us (loop {loop / cp * 1e6:.0f} us, recording "
        f"{other / cp * 1e6:.0f} us): one core at 100% would carry ~{cp / (loop + other):,.0f} calls/s. "
        f"Client-seen latency through the proxy p50 {ms(pct(lat, .5))} ms, p99 {ms(pct(lat, .99))} ms.",
        f"  Rows: {r['rows']['fast'][0]:,} calls recorded ({r['rows']['fast'][1]:,} ok) for {r['sent']['fast']:,} "
        f"sent; paced streams {r['rows']['paced'][1]:,} ok of {r['sent']['paced']:,}. Client errors: "
        f"{sum(r[k]['proxy']['errors'] + r[k]['direct']['errors'] for k in ('lat', 'ttft', 'tput', 'streams'))}.",
    ]


def report(results: dict, s: Settings, quick: bool, prof_rate: float) -> str:
    versions = (f"`nproc` {os.cpu_count()}, Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
                f"uvloop {uvloop.__version__ if uvloop else 'absent'}, DuckDB {duckdb.__version__}, "
                f"{platform.machine()}")  # fmt: skip
    lines = [
        "## proxy_overhead",
        "",
        f"`python bench/proxy_overhead.py{' --quick' if quick else ''}` on {date.today()}: {versions}.",
        f"Proxy alone on core {PROXY_CORE} (loop, recorder thread and DuckDB); scripted engine (uvloop) and load "
        f"generator (raw HTTP/1.1 on uvloop) on core {LOAD_CORE}, each in its own process. Chat calls: ~2 kB "
        f"request, engine answers {PROMPT_TOKENS} prompt ids + {COMPLETION_TOKENS} tokens with logprobs, "
        "recording on. Direct requests carry the body the proxy sends upstream. LiteLLM for scale: +4.3 ms p50, "
        "+9.8 ms p99 at c=1, ~180 calls/s.",
        f"Settings: {', '.join(f'{k}={v}' for k, v in asdict(s).items())}; paced engine "
        f"chunk_delay_s={CHUNK_DELAY_S}.",
        "",
        "| measurement | direct | proxy | added / ratio | goal | met |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for kind, r in results.items():
        lines += rows_for(kind, r, s)
    lines += ["", "What limited the throughput numbers (CPU share of one core, sampled during the windows):", ""]
    for kind, r in results.items():
        lines += limits_for(kind, r, s)
    lines += ["", f"- Under cProfile (asyncio, loop thread only) the proxy carried {prof_rate:,.0f} calls/s."]
    return "\n".join(lines)


def write_docs(text: str) -> None:
    section = f"{START}\n{text}\n{END}"
    current = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n\nNumbers written by the scripts in bench/.\n"
    if START in current and END in current:
        before, rest = current.split(START, 1)
        updated = before + section + rest.split(END, 1)[1]
    else:
        updated = current.rstrip("\n") + "\n\n" + section + "\n"
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(updated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (under a minute)")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    s = QUICK if args.quick else Settings()
    if len(os.sched_getaffinity(0)) < 2:
        print("warning: fewer than 2 cores; proxy, engine and load generator share one", file=sys.stderr)
    _pin(LOAD_CORE)  # this process mostly sleeps; keep it off the proxy's core
    ctx = multiprocessing.get_context("spawn")
    engine = pool = None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            engine = Child(_engine_main, LOAD_CORE)
            pool = ctx.Pool(1, initializer=_pin, initargs=(LOAD_CORE,))
            for kind in ("asyncio", "uvloop") if uvloop else ("asyncio",):
                results[kind] = measure(pool, engine, kind, Path(tmp), s)
            print("[asyncio] cProfile under load ...", flush=True)
            prof_text, prof_rate = profile(pool, engine, Path(tmp), s)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            if engine is not None:
                engine.stop()
    text = report(results, s, args.quick, prof_rate)
    print(text)
    print("\ncProfile of the proxy's loop thread under load:\n" + prof_text)
    if not args.no_docs:
        write_docs(text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
