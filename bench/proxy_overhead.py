"""What the recording proxy costs an LLM call: direct-to-engine and through-the-proxy, side by side in one run.

Three processes, pinned: the proxy alone on core 0 (its event loop, the recorder thread and DuckDB share that one
core); the scripted engine and the load generator on core 1, each in its own process. The engine is
`proxy.scripted.ScriptedEngine` (on uvloop) answering chat calls with 512 prompt ids and 32 completion tokens with
logprobs. Recording is on, into a DuckDB file in a temp dir.

Direct requests carry the body the proxy itself sends upstream (built with `proxy.capture.prepare`), so the engine
does the same work on both paths and the difference is the proxy hop. The load generator is a minimal keep-alive
HTTP/1.1 client on asyncio.Protocol (uvloop): an aiohttp client would spend more CPU per call than the engine, on
the engine's core. CPU time of every process, and of the machine, is sampled during each measurement, so the
report says which core was the limit and how much a co-tenant took.

For the proxy on the stdlib asyncio loop and on uvloop:
  1. c=1 non-stream latency, requests alternating direct / proxy / proxy with its writes deferred to shutdown
     (the third isolates what the recorder's batch writes cost the loop).
  2. c=64 throughput, windows alternating direct / proxy; then the proxy is stopped (it flushes) and the rows in
     `calls` are counted against the calls answered.
  3. streams: time to first content chunk at c=1 (engine 2 ms between tokens), a 32-chunk stream that arrives
     all at once at c=1, and inter-chunk gaps at c=50 (engine 20 ms between tokens).
Then the asyncio proxy once more under load with cProfile (CPU time of its loop thread).

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
PROMPT_TOKENS, COMPLETION_TOKENS = 512, 32
SERVED_MODEL = "scripted-model"
ENGINES = {  # name: what the scripted engine does
    "fast": Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS),
    "trickle": Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=4, chunk_delay_s=0.002),
    "paced": Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS, chunk_delay_s=0.02),
}
DEFERRED = {"record_batch": 10**9, "record_delay_s": 10**6}  # the recorder writes only at shutdown
PROXIES = {"fast": ("fast", {}), "deferred": ("fast", DEFERRED), "trickle": ("trickle", {}), "paced": ("paced", {})}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
START, END = "<!-- proxy_overhead:start -->", "<!-- proxy_overhead:end -->"


@dataclass(frozen=True)
class Settings:
    latency_n: int = 2000  # sequential non-stream requests per path at c=1
    ttft_n: int = 500  # sequential streams per path at c=1 (trickle engine, ~10 ms each)
    burst_n: int = 1000  # sequential 32-chunk streams per path at c=1 (fast engine: all chunks at once)
    warmup_n: int = 100  # per path, before each c=1 series
    concurrency: int = 64
    rounds: int = 2  # throughput windows per path, alternating direct / relay / proxy
    window_s: float = 4.0  # measured part of each window
    warmup_s: float = 0.5  # load before each window's measured part
    stream_concurrency: int = 50
    streams_per_client: int = 6  # paced streams (32 chunks, 20 ms apart) per concurrent client, per path
    profile_s: float = 4.0
    quiet_wait_s: float = 15.0  # before each phase, wait up to this long for co-tenants to go quiet


QUICK = Settings(latency_n=400, ttft_n=100, burst_n=200, warmup_n=50, rounds=1, window_s=2.0,
                 streams_per_client=2, profile_s=2.0, quiet_wait_s=3.0)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Processes: pinning, loops, the engine, the proxy, and whose CPU is whose.
# ---------------------------------------------------------------------------------------------------------------


def _pin(core: int) -> None:
    """Pin every thread of this process (later threads inherit it) to one core, if the machine has it."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # no such core here: everything shares what there is
            os.sched_setaffinity(int(tid), {core})


def _run(coro, loop_kind: str = "uvloop"):
    factory = uvloop.new_event_loop if loop_kind == "uvloop" and uvloop else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _engine_main(conn, core: int) -> None:
    """The scripted engines of ENGINES in one process, each on its own port."""
    _pin(core)

    async def main():
        engines = {name: ScriptedEngine(script) for name, script in ENGINES.items()}
        conn.send({name: await engine.start() for name, engine in engines.items()})
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        while not stop.is_set():  # the scripted engine keeps every request body: forget them as we go
            for engine in engines.values():
                engine.requests.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        for engine in engines.values():
            await engine.stop()

    _run(main(), "uvloop")


class _Down(asyncio.Protocol):
    """The agent's side of a byte relay: opens its own connection upstream, copies bytes both ways."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.transport = self.up = None
        self.early: list[bytes] = []  # bytes that came before the upstream connection was open

    def connection_made(self, transport):
        self.transport = transport
        asyncio.ensure_future(self._connect())

    async def _connect(self):
        _, self.up = await asyncio.get_running_loop().create_connection(lambda: _Up(self), self.host, self.port)
        for data in self.early:
            self.up.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.early.append(data)
        else:
            self.up.transport.write(data)

    def connection_lost(self, exc):
        if self.up is not None:
            self.up.transport.close()


class _Up(asyncio.Protocol):
    def __init__(self, down: _Down):
        self.down, self.transport = down, None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.down.transport.write(data)

    def connection_lost(self, exc):
        self.down.transport.close()


def _relay_main(conn, core: int, upstreams: dict[str, str]) -> None:
    """A byte relay on uvloop, one port per engine: what one more process hop through core 0 costs, with nothing
    parsed or recorded. The floor under the proxy's added latency on this pinning."""
    _pin(core)

    async def main():
        loop = asyncio.get_running_loop()
        servers, urls = [], {}
        for name, url in upstreams.items():
            parts = urlsplit(url)
            server = await loop.create_server(lambda p=parts: _Down(p.hostname, p.port), "127.0.0.1", 0)
            servers.append(server)
            urls[name] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        conn.send(urls)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        for server in servers:
            server.close()

    _run(main(), "uvloop")


def _proxy_main(conn, core: int, upstream: str, db_path: str, loop_kind: str, overrides: dict,
                profile_path: str | None) -> None:  # fmt: skip
    """The proxy as `harness proxy` runs it (serve_forever); SIGUSR1 / SIGUSR2 start / stop cProfile if asked."""
    _pin(core)
    config = ProxyConfig(upstream_url=upstream, db_path=Path(db_path), port=0, served_model=SERVED_MODEL,
                         **overrides)  # fmt: skip
    profiler = cProfile.Profile(time.thread_time) if profile_path else None  # CPU time of the loop thread

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


def _core_busy() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) jiffies from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *fields = line.split()
                values = [int(v) for v in fields]
                out[int(name[3:])] = (sum(values) - values[3] - values[4], sum(values))
    return out


def _our_cpu() -> float:
    """CPU seconds of this process and all its children (engine, proxies, load generator)."""
    total = 0.0
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class CoTenant:
    """CPU that processes outside this benchmark used meanwhile, in cores (2.0: both cores, all the time)."""

    def __init__(self):
        self.busy, self.ours, self.t = _core_busy(), _our_cpu(), time.perf_counter()

    def cores(self) -> float:
        busy, ours, t = _core_busy(), _our_cpu(), time.perf_counter()
        jiffies = sum(busy[c][0] - self.busy[c][0] for c in busy)
        return max(0.0, jiffies / os.sysconf("SC_CLK_TCK") - (ours - self.ours)) / (t - self.t)


def wait_quiet(max_s: float, threshold: float = 0.15) -> float:
    """Wait up to max_s for processes outside this benchmark to use under `threshold` cores; what they used last."""
    deadline = time.perf_counter() + max_s
    while True:
        meter = CoTenant()
        time.sleep(0.5)
        used = meter.cores()
        if used < threshold or time.perf_counter() >= deadline:
            return used


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
    async def open(cls, raw: bytes) -> Http:
        host, port = raw.split(b"\r\nHost: ", 1)[1].split(b"\r\n", 1)[0].decode().rsplit(":", 1)
        _, conn = await asyncio.get_running_loop().create_connection(cls, host, int(port))
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
    """c=1: one request per target in turn (order reversed every round); latency, and TTFT for streams."""

    async def main():
        conns = {name: await Http.open(raw) for name, raw in targets.items()}
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


def client_load(raw: bytes, concurrency: int, warmup_s: float, window_s: float) -> dict:
    """`concurrency` connections in closed loops; counts answers completed inside the measured window."""

    async def main():
        conns = [await Http.open(raw) for _ in range(concurrency)]
        t_measure = time.perf_counter() + warmup_s
        t_end = t_measure + window_s
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


def client_streams(raw: bytes, concurrency: int, per_client: int, stagger_s: float) -> dict:
    """`concurrency` clients each reading `per_client` streams in a row; gaps between content chunks."""

    async def main():
        out = {"gaps": [], "ttft": [], "errors": 0, "sent": 0}

        async def worker(i: int):
            conn = await Http.open(raw)
            await asyncio.sleep(i * stagger_s)  # start spread over one chunk interval, not in lockstep
            for _ in range(per_client):
                t0 = time.perf_counter()
                status, _, events = await conn.call(raw, stream=True)
                out["sent"] += 1
                out["errors"] += status != 200
                times = content_times(events)
                out["ttft"].append(times[0] - t0)
                out["gaps"].extend(b - a for a, b in zip(times, times[1:], strict=False))
            conn.transport.close()

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
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


def request_bytes(url: str, body: bytes) -> bytes:
    parts = urlsplit(url + "/v1/chat/completions")
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer sk-bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


def requests_for(engine_url: str, stream: bool, **proxy_urls: str) -> dict[str, bytes]:
    """To each proxy the agent's request; to the engine ("direct") the body the proxy would send it."""
    agent = chat_body(stream)
    upstream = prepare(CHAT, agent, ProxyConfig(upstream_url=engine_url), SERVED_MODEL).upstream_body
    return {"direct": request_bytes(engine_url, upstream)} | {
        name: request_bytes(url, agent) for name, url in proxy_urls.items()
    }


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def throughput(pool, reqs: dict[str, bytes], hops: dict[str, Child], engine: Child, s: Settings) -> dict:
    """Alternating windows; CPU of the hop on core 0 (loop thread / other threads), the engine, and each core."""
    keys = ("calls_per_s", "client_cpu", "engine_cpu", "hop_loop_cpu", "hop_other_cpu", "core0", "core1")
    out = {name: {"latency": [], "errors": 0, "sent": 0} | {k: [] for k in keys} for name in reqs}
    for _ in range(s.rounds):
        for name, raw in reqs.items():
            hop = hops.get(name, hops["proxy"])  # direct: the idle proxy, to show core 0 free
            pending = pool.apply_async(client_load, (raw, s.concurrency, s.warmup_s, s.window_s))
            time.sleep(s.warmup_s + 0.1)
            t0, (p0, q0), e0, c0 = time.perf_counter(), hop.cpu(), sum(engine.cpu()), _core_busy()
            time.sleep(s.window_s - 0.2)
            t1, (p1, q1), e1, c1 = time.perf_counter(), hop.cpu(), sum(engine.cpu()), _core_busy()
            r, o, dt = pending.get(), out[name], t1 - t0
            for k in ("latency", "errors", "sent"):
                o[k] += r[k]
            o["calls_per_s"].append(r["calls_per_s"])
            o["client_cpu"].append(r["client_cpu"])
            o["engine_cpu"].append((e1 - e0) / dt)
            o["hop_loop_cpu"].append((p1 - p0) / dt)
            o["hop_other_cpu"].append((q1 - q0) / dt)
            for core in (PROXY_CORE, LOAD_CORE):
                o[f"core{core}"].append((c1[core][0] - c0[core][0]) / max(1, c1[core][1] - c0[core][1]))
    return out


def count_rows(db_path: Path) -> tuple[int, int]:
    """(calls, calls with status ok) in a stopped proxy's database."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return con.execute("SELECT count(*), count(*) FILTER (status = 'ok') FROM calls").fetchone()
    finally:
        con.close()


def measure(pool, engine: Child, relay: Child, loop_kind: str, tmp: Path, s: Settings) -> dict:
    """Every measurement for the proxy on one loop kind; then the proxies are stopped and their rows counted."""
    urls, relays = engine.served, relay.served
    proxies: dict[str, Child] = {}
    r = {"cotenant": {}, "waited": {}}

    def run_phase(name: str, label: str, fn) -> None:
        print(f"[{loop_kind}] {label} ...", flush=True)
        t0 = time.perf_counter()
        wait_quiet(s.quiet_wait_s)
        r["waited"][name] = time.perf_counter() - t0
        meter = CoTenant()
        r[name] = fn()
        r["cotenant"][name] = meter.cores()

    try:
        for name, (upstream, overrides) in PROXIES.items():
            db = str(tmp / f"{loop_kind}-{name}.duckdb")
            proxies[name] = Child(_proxy_main, PROXY_CORE, urls[upstream], db, loop_kind, overrides, None)
        p = {name: child.served for name, child in proxies.items()}
        reqs = requests_for(urls["fast"], False, relay=relays["fast"], proxy=p["fast"], deferred=p["deferred"])
        run_phase("lat", f"c=1 latency, {s.latency_n} requests per path",
                  lambda: pool.apply(client_alternating, (reqs, s.latency_n, s.warmup_n, False)))
        reqs = requests_for(urls["trickle"], True, relay=relays["trickle"], proxy=p["trickle"])
        run_phase("ttft", f"c=1 time to first token, {s.ttft_n} streams per path",
                  lambda: pool.apply(client_alternating, (reqs, s.ttft_n, s.warmup_n, True)))
        reqs = requests_for(urls["fast"], True, proxy=p["fast"])
        run_phase("burst", f"c=1 32-chunk streams, {s.burst_n} per path",
                  lambda: pool.apply(client_alternating, (reqs, s.burst_n, s.warmup_n, True)))
        reqs = requests_for(urls["fast"], False, relay=relays["fast"], proxy=p["fast"])
        run_phase("tput", f"c={s.concurrency} throughput, {s.rounds} x {s.window_s:g} s per path",
                  lambda: throughput(pool, reqs, {"relay": relay, "proxy": proxies["fast"]}, engine, s))
        reqs = requests_for(urls["paced"], True, proxy=p["paced"])
        stagger = ENGINES["paced"].chunk_delay_s / s.stream_concurrency
        run_phase("streams", f"c={s.stream_concurrency} paced streams",
                  lambda: {name: pool.apply(client_streams, (raw, s.stream_concurrency, s.streams_per_client, stagger))
                           for name, raw in reqs.items()})  # fmt: skip
    finally:
        for child in proxies.values():
            child.stop()
    answered = {"fast": sum(r[k]["proxy"]["sent"] for k in ("lat", "burst", "tput")),
                "deferred": r["lat"]["deferred"]["sent"], "trickle": r["ttft"]["proxy"]["sent"],
                "paced": r["streams"]["proxy"]["sent"]}  # fmt: skip
    rows = {name: count_rows(tmp / f"{loop_kind}-{name}.duckdb") for name in proxies}
    r["recorded"] = {name: (rows[name][1], answered[name]) for name in proxies}  # (ok rows, calls answered)
    r["all_recorded"] = all(rows[name][0] == rows[name][1] == answered[name] for name in proxies)
    return r


def profile(pool, engine: Child, tmp: Path, s: Settings) -> tuple[str, float]:
    """The asyncio proxy under c=64 with cProfile on its loop thread (thread CPU time): top 15 own and cumulative."""
    fast_url = engine.served["fast"]
    stats_path = tmp / "proxy.prof"
    proxy = Child(_proxy_main, PROXY_CORE, fast_url, str(tmp / "profile.duckdb"), "asyncio", {}, str(stats_path))
    try:
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
    return text.getvalue(), rate


# ---------------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------------


def ms(x: float) -> str:
    return f"{x * 1000:.3f}"


def _added(d: list[float], p: list[float], q: float) -> tuple[str, float]:
    add = pct(p, q) - pct(d, q)
    return f"{ms(pct(d, q))} -> {ms(pct(p, q))} (**{add * 1000:+.3f}**)", add


def _cells(r: dict, s: Settings) -> dict[str, tuple[str, bool | None]]:
    """One loop kind's results: row key -> (cell text, goal met or None)."""
    lat, tput, streams = r["lat"], r["tput"], r["streams"]
    d, p, df = lat["direct"]["latency"], lat["proxy"]["latency"], lat["deferred"]["latency"]
    cells = {}
    text, add = _added(d, p, 0.5)
    cells["lat50"] = (text, add <= 0.0006)
    text, add = _added(d, p, 0.99)
    cells["lat99"] = (text, add <= 0.002)
    cells["lat99_deferred"] = (_added(d, df, 0.99)[0] + f"; p50 {_added(d, df, 0.5)[1] * 1000:+.3f}", None)
    cd, cp = mean(tput["direct"]["calls_per_s"]), mean(tput["proxy"]["calls_per_s"])
    cells["tput"] = (f"{cd:,.0f} -> **{cp:,.0f}** ({cp / cd:.2f}x)", cp >= 3000 and r["all_recorded"])
    share = mean(tput["proxy"]["proxy_loop_cpu"]) + mean(tput["proxy"]["proxy_other_cpu"])
    cells["capacity"] = (f"**{cp / share:,.0f}** ({share / cp * 1e6:.0f} us CPU a call)", cp / share >= 3000)
    recorded = sum(ok for ok, _ in r["recorded"].values()), sum(n for _, n in r["recorded"].values())
    cells["rows"] = (f"{recorded[0]:,} ok rows for {recorded[1]:,} calls answered", r["all_recorded"])
    t_d, t_p = r["ttft"]["direct"]["ttft"], r["ttft"]["proxy"]["ttft"]
    text, add = _added(t_d, t_p, 0.5)
    cells["ttft50"] = (text, add <= 0.001)
    cells["ttft99"] = (_added(t_d, t_p, 0.99)[0], None)
    b_d, b_p = r["burst"]["direct"]["latency"], r["burst"]["proxy"]["latency"]
    cells["burst"] = (_added(b_d, b_p, 0.5)[0], None)
    cells["ttft50_c50"] = (_added(streams["direct"]["ttft"], streams["proxy"]["ttft"], 0.5)[0], None)
    g_d, g_p = streams["direct"]["gaps"], streams["proxy"]["gaps"]
    for q, key in ((0.5, "gap50"), (0.99, "gap99")):
        ratio = pct(g_p, q) / pct(g_d, q)
        cells[key] = (f"{ms(pct(g_d, q))} -> {ms(pct(g_p, q))} (**{ratio:.2f}x**)", 0.9 <= ratio <= 1.1)
    bunched = [sum(g < 0.002 for g in gaps) / len(gaps) for gaps in (g_d, g_p)]
    cells["bunched"] = (f"{bunched[0]:.1%} -> {bunched[1]:.1%}", bunched[1] <= bunched[0] + 0.01)
    return cells


ROWS = {  # row key: (measurement, goal)
    "lat50": ("c=1 non-stream latency p50, ms", "<= +0.6"),
    "lat99": ("c=1 non-stream latency p99, ms", "<= +2"),
    "lat99_deferred": ("same p99, proxy writing only at shutdown (diagnostic), ms", "-"),
    "tput": ("c=64 calls/s, direct -> proxy (recorded)", ">= 3,000"),
    "capacity": ("c=64 proxy calls/s per full core (calls/s / proxy CPU share)", ">= 3,000"),
    "rows": ("rows in `calls` after the proxies stopped", "all"),
    "ttft50": ("c=1 time to first content chunk p50, ms (2 ms/token engine)", "<= +1"),
    "ttft99": ("same, p99, ms", "-"),
    "burst": ("c=1 32-chunk stream arriving at once, whole stream p50, ms", "-"),
    "ttft50_c50": ("c=50 time to first content chunk p50, ms (20 ms/token engine)", "-"),
    "gap50": ("c=50 inter-chunk gap p50, ms", "0.9..1.1x"),
    "gap99": ("c=50 inter-chunk gap p99, ms", "0.9..1.1x"),
    "bunched": ("c=50 gaps under 2 ms (chunks bunched together)", "as direct"),
}


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def limits_for(kind: str, r: dict, s: Settings) -> list[str]:
    """Where the c=64 time went: each process's share of its core, the co-tenants', and the proxy's CPU a call."""
    td, tp = r["tput"]["direct"], r["tput"]["proxy"]
    cp = mean(tp["calls_per_s"])
    loop, other = mean(tp["proxy_loop_cpu"]), mean(tp["proxy_other_cpu"])
    other0 = mean(tp["core0"]) - loop - other
    other1_d = mean(td["core1"]) - mean(td["engine_cpu"]) - mean(td["client_cpu"])
    other1_p = mean(tp["core1"]) - mean(tp["engine_cpu"]) - mean(tp["client_cpu"])
    cot = ", ".join(f"{k} {v:.2f}" for k, v in r["cotenant"].items())
    busy0, busy1_d, busy1_p = mean(tp["core0"]), mean(td["core1"]), mean(tp["core1"])
    return [
        f"- **{kind}**: direct {mean(td['calls_per_s']):,.0f}/s with core 1 {busy1_d:.0%} busy: engine "
        f"{mean(td['engine_cpu']):.0%} + load generator {mean(td['client_cpu']):.0%} + others "
        f"{max(0, other1_d):.0%} ({_bound(busy1_d)}). Through the proxy {cp:,.0f}/s with core 0 {busy0:.0%} busy: "
        f"proxy loop thread {loop:.0%} + recorder and DuckDB threads {other:.0%} + others {max(0, other0):.0%} "
        f"({_bound(busy0)}); core 1 {busy1_p:.0%} busy: engine {mean(tp['engine_cpu']):.0%} + load generator "
        f"{mean(tp['client_cpu']):.0%} + others {max(0, other1_p):.0%} ({_bound(busy1_p)}).",
        f"  Proxy CPU a call: {loop / cp * 1e6:.0f} us on the loop thread + {other / cp * 1e6:.0f} us recording. "
        f"Client-seen latency through the proxy at c={s.concurrency}: p50 {ms(pct(tp['latency'], 0.5))} ms, "
        f"p99 {ms(pct(tp['latency'], 0.99))} ms.",
        f"  Co-tenant CPU (processes outside this benchmark, in cores of the 2) per phase: {cot}.",
    ]


def _bound(busy: float) -> str:
    return "saturated: the limit" if busy >= 0.9 else "not saturated"


def report(results: dict, s: Settings, quick: bool, prof_rate: float) -> str:
    versions = (f"`nproc` {os.cpu_count()}, Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
                f"uvloop {uvloop.__version__ if uvloop else 'absent'}, DuckDB {duckdb.__version__}, "
                f"{platform.machine()}")  # fmt: skip
    kinds = list(results)
    cells = {kind: _cells(results[kind], s) for kind in kinds}
    lines = [
        "## proxy_overhead",
        "",
        f"`python bench/proxy_overhead.py{' --quick' if quick else ''}` on {date.today()}: {versions}.",
        f"Proxy process pinned alone to core {PROXY_CORE} (event loop, recorder thread, DuckDB); scripted engine "
        f"(uvloop) and load generator (raw keep-alive HTTP/1.1 on uvloop) on core {LOAD_CORE}, each in its own "
        f"process. Chat calls: ~2 kB request; the engine answers {PROMPT_TOKENS} prompt ids + {COMPLETION_TOKENS} "
        "tokens with logprobs; recording on (default batch 256 / 0.2 s). Direct requests carry the body the proxy "
        "sends upstream. Cells: direct -> proxy (added, or proxy/direct). LiteLLM for scale: +4.3 ms p50, "
        "+9.8 ms p99 at c=1, ~180 calls/s.",
        f"Settings: {', '.join(f'{k}={v}' for k, v in asdict(s).items())}; engines: "
        + "; ".join(f"{n} {e.completion_tokens} tokens, chunk_delay_s={e.chunk_delay_s}" for n, e in ENGINES.items())
        + ".",
        "",
        "| measurement | goal | " + " | ".join(f"{k}: direct -> proxy | met" for k in kinds) + " |",
        "| --- | --- | " + " | ".join("--- | ---" for _ in kinds) + " |",
    ]
    for key, (what, goal) in ROWS.items():
        row = " | ".join(f"{cells[k][key][0]} | {_met(cells[k][key][1])}" for k in kinds)
        lines.append(f"| {what} | {goal} | {row} |")
    lines += ["", "What limited the c=64 numbers (share of one core, sampled during the measured windows):", ""]
    for kind in kinds:
        lines += limits_for(kind, results[kind], s)
    lines += [
        f"- Under cProfile (asyncio, loop thread CPU time) the proxy carried {prof_rate:,.0f} calls/s; the profile "
        "is printed by the script, not kept here.",
    ]
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
    engine = relay = pool = None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            engine = Child(_engine_main, LOAD_CORE)
            relay = Child(_relay_main, PROXY_CORE, engine.served)
            pool = multiprocessing.get_context("spawn").Pool(1, initializer=_pin, initargs=(LOAD_CORE,))
            for kind in ("asyncio", "uvloop") if uvloop else ("asyncio",):
                results[kind] = measure(pool, engine, relay, kind, Path(tmp), s)
            print("[asyncio] cProfile under load ...", flush=True)
            prof_text, prof_rate = profile(pool, engine, Path(tmp), s)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            for child in (relay, engine):
                if child is not None:
                    child.stop()
    text = report(results, s, args.quick, prof_rate)
    print(text)
    print("\ncProfile of the proxy's loop thread under load (CPU time):\n" + prof_text)
    if not args.no_docs:
        write_docs(text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
