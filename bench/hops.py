"""The processes of bench/proxy_overhead.py: each hop (engine, byte relay, proxy) in its own process pinned to a
core, with a pipe to the parent, plus the bookkeeping of whose CPU is whose on the machine. A proxy may run another
commit's code (`proxy_main`'s `code`: a checkout of that commit), for a before / after comparison in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import multiprocessing
import os
import pstats
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from bench.loadgen import client_load, client_streams, run_loop
from proxy import ProxyConfig, serve_forever
from proxy.scripted_engine import Script, ScriptedEngine

PROXY_CORE, LOAD_CORE = 0, 1  # the hops' core; the engine's and the load generator's
PROMPT_TOKENS, COMPLETION_TOKENS = 512, 32
SERVED_MODEL = "scripted-model"
ENGINES = {  # name: what the scripted engine does
    "fast": Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS),
    "trickle": Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=2, chunk_delay_s=0.002),
    "paced": Script(prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS, chunk_delay_s=0.02),
}


def pin(core: int) -> None:
    """Pin every thread of this process (later threads inherit it) to one core, if the machine has it."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # no such core here: everything shares what there is
            os.sched_setaffinity(int(tid), {core})


def watch_parent(conn, answer=None) -> None:
    """Answer the parent's requests on the pipe with `answer()`; when the parent is gone, SIGTERM ourselves so
    nothing outlives a killed benchmark."""
    loop = asyncio.get_running_loop()

    def readable():
        try:
            conn.recv()
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            os.kill(os.getpid(), signal.SIGTERM)
            return
        conn.send(answer() if answer else None)

    loop.add_reader(conn.fileno(), readable)


def engine_main(conn, core: int) -> None:
    """The scripted engines of ENGINES in one process, each on its own port."""
    pin(core)

    async def main():
        engines = {name: ScriptedEngine(script) for name, script in ENGINES.items()}
        conn.send({name: await engine.start() for name, engine in engines.items()})
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        watch_parent(conn)
        while not stop.is_set():  # the scripted engine keeps every request body: forget them as we go
            for engine in engines.values():
                engine.requests.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        for engine in engines.values():
            await engine.stop()

    run_loop(main(), "uvloop")


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


def relay_main(conn, core: int, upstreams: dict[str, str]) -> None:
    """A byte relay on uvloop, one port per engine: what one more process hop through core 0 costs, with nothing
    parsed or recorded. The floor under the proxy's added latency on this pinning."""
    pin(core)

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
        watch_parent(conn)
        await stop.wait()
        for server in servers:
            server.close()

    run_loop(main(), "uvloop")


def proxy_code(path: str | None):
    """(ProxyConfig, serve_forever) of this tree, or of the checkout at `path` (another commit): its `proxy` and
    `harness` packages then replace this tree's in this process (a proxy's own process: nothing else runs here)."""
    if path is None:
        return ProxyConfig, serve_forever
    for name in [n for n in sys.modules if n.split(".")[0] in ("proxy", "harness")]:
        del sys.modules[name]
    sys.path.insert(0, path)
    import proxy

    assert proxy.__file__.startswith(str(Path(path).resolve())), proxy.__file__
    return proxy.ProxyConfig, proxy.serve_forever


def proxy_main(conn, core: int, upstream: str, db_path: str, loop_kind: str, overrides: dict,
                profile_path: str | None, code: str | None = None) -> None:  # fmt: skip
    """The proxy as `harness proxy` runs it (serve_forever), this tree's or `code`'s (proxy_code); SIGUSR1 /
    SIGUSR2 start / stop cProfile if asked."""
    pin(core)
    config_class, serve = proxy_code(code)
    config = config_class(upstream_url=upstream, db_path=Path(db_path), port=0, served_model=SERVED_MODEL,
                          **overrides)  # fmt: skip
    profiler = cProfile.Profile(time.thread_time) if profile_path else None  # CPU time of the loop thread
    gc_s = [0.0, 0.0]  # CPU seconds spent in garbage collections, start of the current one

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_s[1] = time.thread_time()
        else:
            gc_s[0] += time.thread_time() - gc_s[1]

    gc.callbacks.append(on_gc)

    def stop_profile():
        profiler.disable()
        profiler.dump_stats(profile_path)

    def ready(server):
        loop = asyncio.get_running_loop()
        if profiler is not None:
            loop.add_signal_handler(signal.SIGUSR1, profiler.enable)
            loop.add_signal_handler(signal.SIGUSR2, stop_profile)
        watch_parent(conn, lambda: gc_s[0])  # Child.gc_seconds()
        conn.send(server.url)

    run_loop(serve(config, on_ready=ready), loop_kind)


class Child:
    """A pinned child process that reports what it serves on a pipe; stopped with SIGTERM (the proxy flushes)."""

    def __init__(self, target, *args):
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.name = target.__name__
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        self.ps = psutil.Process(self.process.pid)
        self.served = None

    def ready(self, timeout_s: float = 60) -> Child:
        """Wait for what the child serves (its URL, or URLs by name)."""
        if self.served is None:
            if not self._pipe.poll(timeout_s):
                raise RuntimeError(f"{self.name} did not come up in {timeout_s} s (exit code {self.process.exitcode})")
            self.served = self._pipe.recv()
        return self

    def gc_seconds(self) -> float:
        """A proxy's CPU seconds in garbage collection so far."""
        self._pipe.send(1)
        return self._pipe.recv() if self._pipe.poll(10) else float("nan")

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


def core_busy() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) jiffies from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *fields = line.split()
                values = [int(v) for v in fields]
                out[int(name[3:])] = (sum(values) - values[3] - values[4], sum(values))
    return out


def our_cpu() -> float:
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
        self.busy, self.ours, self.t = core_busy(), our_cpu(), time.perf_counter()

    def cores(self) -> float:
        busy, ours, t = core_busy(), our_cpu(), time.perf_counter()
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
# The phases that meter the hops' CPU while the load runs.
# ---------------------------------------------------------------------------------------------------------------


def throughput(pool, reqs: dict[str, bytes], hops: dict[str, Child], engine: Child, s) -> dict:
    """Windows rotating over the paths; CPU of the hop on core 0 (loop thread / other threads), the engine, and
    how busy each core was. `s`: bench/proxy_overhead.py's Settings."""
    keys = ("calls_per_s", "client_cpu", "engine_cpu", "hop_loop_cpu", "hop_other_cpu", "hop_gc_cpu", "core0", "core1")
    out = {name: {"latency": [], "errors": 0, "sent": 0} | {k: [] for k in keys} for name in reqs}
    names = list(reqs)
    for i in range(s.rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            hop = hops.get(name)
            pending = pool.apply_async(client_load, (reqs[name], s.concurrency, s.warmup_s, s.window_s))
            time.sleep(s.warmup_s + 0.1)
            g0 = hop.gc_seconds() if hop and hop.name == "proxy_main" else 0.0
            t0, h0, e0, c0 = time.perf_counter(), hop.cpu() if hop else (0, 0), sum(engine.cpu()), core_busy()
            time.sleep(s.window_s - 0.2)
            t1, h1, e1, c1 = time.perf_counter(), hop.cpu() if hop else (0, 0), sum(engine.cpu()), core_busy()
            g1 = hop.gc_seconds() if hop and hop.name == "proxy_main" else 0.0
            r, o, dt = pending.get(), out[name], t1 - t0
            for k in ("latency", "errors", "sent"):
                o[k] += r[k]
            o["calls_per_s"].append(r["calls_per_s"])
            o["client_cpu"].append(r["client_cpu"])
            o["engine_cpu"].append((e1 - e0) / dt)
            o["hop_loop_cpu"].append((h1[0] - h0[0]) / dt)
            o["hop_other_cpu"].append((h1[1] - h0[1]) / dt)
            o["hop_gc_cpu"].append((g1 - g0) / dt)
            for core in (PROXY_CORE, LOAD_CORE):
                o[f"core{core}"].append((c1[core][0] - c0[core][0]) / max(1, c1[core][1] - c0[core][1]))
        time.sleep(s.settle_s)
    return out


def streams(pool, reqs: dict[str, bytes], proxies: dict[str, Child], s) -> dict:
    """Each path in turn at c=50, with the CPU share its proxy took meanwhile."""
    stagger = ENGINES["paced"].chunk_delay_s / s.stream_concurrency
    out = {}
    for name, raw in reqs.items():
        hop = proxies.get(f"{name}-paced")
        c0, t0 = sum(hop.cpu()) if hop else 0.0, time.perf_counter()
        out[name] = pool.apply(client_streams, (raw, s.stream_concurrency, s.streams_per_client, stagger))
        out[name]["hop_cpu_s"] = (sum(hop.cpu()) if hop else 0.0) - c0
        out[name]["hop_cpu"] = out[name]["hop_cpu_s"] / (time.perf_counter() - t0)
    return out


PROFILE_PARTS = {  # share of the loop thread's CPU: (file, function) whose cumulative time counts
    "upstream aiohttp client (ClientSession._request, response read)": [("client.py", "_request"),
                                                                         ("client_reqrep.py", "read")],
    "app._prepare (parse, check, translate the request)": [("app.py", "_prepare")],
    "Capture.take_response (collect ids, strip, model name)": [("forward.py", "take_response")],
    "Capture.to_call (build the record)": [("forward.py", "to_call")],
    "Recorder.record_call": [("recorder.py", "record_call")],
    "proxy handler, all of it (app._llm_call)": [("app.py", "_llm_call")],
}  # fmt: skip


def profile_shares(stats: pstats.Stats) -> dict[str, float]:
    """Share of the profiled loop thread's CPU time spent under each of PROFILE_PARTS."""
    cum: dict[tuple[str, str], float] = {}
    for (file, _, function), (_, _, _, cumtime, _) in stats.stats.items():
        cum[file, function] = cum.get((file, function), 0.0) + cumtime
    return {part: sum(cum.get(key, 0.0) for key in keys) / stats.total_tt for part, keys in PROFILE_PARTS.items()}
