"""What transparent mode's hop costs an LLM call: an agent pointed at the recording proxy (OPENAI_BASE_URL) against
the same agent calling https://api.openai.com/v1 through the embedded mitmproxy hop, side by side in one run.

    (a) plain:  client --http--> recording proxy /e/<episode>/v1 --> scripted engine
    (b) hop:    client --HTTPS_PROXY, CONNECT + TLS--> mitmproxy (proxy/mitm_addon.py) --http--> the same proxy

The engine is proxy/scripted_engine.py (uvloop) with a fixed short answer (64 prompt ids, 4 tokens; streams
2 ms between tokens), so the numbers are the hops, not a model. The proxy runs as `harness proxy` does
(serve_forever on asyncio, recording into DuckDB); the hop is started by `proxy.transparent.Interceptor`, under
.venv-mitm's Python, and its agent environment (`agent_env(episode, token)`) gives arm (b) its proxy URL and CA.

The client is httpx (what the openai SDK uses) on asyncio, one AsyncClient per worker, kept for the whole run:
connections are kept alive and reused, so the hop's CONNECT + TLS handshake is paid once per worker connection,
not per call (counted through httpcore's trace hooks and reported). A diagnostic row measures calls with
keep-alive off (a new TCP connection, and for the hop a new CONNECT + TLS handshake, per call).

Pinning: the proxy and the hop on core 0, the scripted engine and the client on core 1. The arms alternate in
batches (the order flips every round) so machine noise hits both; each arm warms up first. CPU time of every
process is sampled per batch, so the report says what a call costs each of them.

    .venv/bin/python bench/transparent_hop.py [--calls 2400] [--no-docs]

Writes its section of docs/BENCHMARKS.md (between the transparent_hop markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

import duckdb
import httpx
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.docs_section import DOCS, write_section  # noqa: E402
from bench.hops import Child, CoTenant, core_busy, pin, proxy_main, wait_quiet, watch_parent  # noqa: E402
from bench.loadgen import pct, run_loop  # noqa: E402
from proxy.scripted_engine import Script, ScriptedEngine  # noqa: E402
from proxy.transparent import Interceptor, TransparentOptions, mitm_python  # noqa: E402

HOP_CORE, LOAD_CORE = 0, 1
CONCURRENCY = 16
SCRIPT = Script(prompt_tokens=64, completion_tokens=4, chunk_delay_s=0.002)
EPISODES = {"plain": "bench-plain", "hop": "bench-hop"}
EPISODE_TOKEN = "hx-bench-episode-token"
AGENT_KEY = "sk-bench-not-a-real-key"
VENDOR_URL = "https://api.openai.com/v1"


@dataclass(frozen=True)
class Settings:
    calls: int = 2400  # non-stream calls per arm, at c=1 and at c=16 each; streams: half as many
    block: int = 50  # c=1 calls per arm in a row before the other arm's turn
    per_worker: int = 16  # c=16: calls per worker in one batch (a batch: 16 x this, then the other arm's turn)
    warmup: int = 20  # calls per worker and arm before measuring (each worker's connection opened and warm)
    no_keepalive: int = 150  # diagnostic: c=1 calls per arm with keep-alive off
    quiet_wait_s: float = 10.0  # before each phase, wait up to this long for other processes to go quiet


# ---------------------------------------------------------------------------------------------------------------
# The processes.
# ---------------------------------------------------------------------------------------------------------------


def engine_main(conn, core: int) -> None:
    """The scripted engine on uvloop, pinned; it keeps every request body, so forget them as we go."""
    pin(core)

    async def main():
        engine = ScriptedEngine(SCRIPT)
        conn.send(await engine.start())
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        watch_parent(conn)
        while not stop.is_set():
            engine.requests.clear()
            engine.authorizations.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        await engine.stop()

    run_loop(main(), "uvloop")


def start_hop(proxy_url: str, home: Path) -> tuple[Interceptor, psutil.Process]:
    """The transparent hop, pinned to the hop core (the subprocess inherits this thread's affinity)."""
    before = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {HOP_CORE})
    try:
        interceptor = Interceptor(TransparentOptions(home=home), log_path=home / "hop.log").start(proxy_url)
    finally:
        os.sched_setaffinity(0, before)
    hop = next(p for p in psutil.Process().children() if any("mitm_addon" in a for a in p.cmdline()))
    return interceptor, hop


# ---------------------------------------------------------------------------------------------------------------
# The client: httpx as the openai SDK uses it.
# ---------------------------------------------------------------------------------------------------------------


def body(stream: bool) -> bytes:
    """A short agent turn, as the openai SDK sends it."""
    out = {"messages": [{"role": "system", "content": "You are a careful agent. Answer briefly."},
                        {"role": "user", "content": "What is 6 * 7? Reply with the number only."}],
           "model": "gpt-4o-mini", "max_tokens": 8, "temperature": 1.0, **({"stream": True} if stream else {})}
    return orjson.dumps(out)


@dataclass
class Arm:
    """One way of reaching the proxy: a base URL and, per worker, an httpx client kept for the whole run."""

    name: str
    base_url: str
    client_kwargs: dict
    clients: list[httpx.AsyncClient] = field(default_factory=list)
    tcp: int = 0  # TCP connections opened (to the proxy, or to the hop)
    tls: int = 0  # TLS handshakes
    sent: int = 0
    errors: int = 0

    def open(self) -> None:
        self.clients = [self.client() for _ in range(CONCURRENCY)]

    def client(self, **more) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=30.0, trust_env=False, **self.client_kwargs, **more)

    async def trace(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            self.tcp += 1
        elif event.endswith(".start_tls.complete"):  # connection.* (direct TLS) or proxy.* (inside a CONNECT)
            self.tls += 1

    async def call(self, client: httpx.AsyncClient, stream: bool) -> tuple[float, float | None]:
        """(seconds to the whole answer, seconds to the first content chunk for a stream)."""
        url, data = self.base_url + "/chat/completions", BODIES[stream]
        headers = {"Authorization": f"Bearer {AGENT_KEY}", "Content-Type": "application/json"}
        ext = {"trace": self.trace}
        t0 = time.perf_counter()
        first = None
        if not stream:
            resp = await client.post(url, content=data, headers=headers, extensions=ext)
            ok = resp.status_code == 200 and bool(resp.json()["choices"][0]["message"]["content"])
        else:
            async with client.stream("POST", url, content=data, headers=headers, extensions=ext) as resp:
                ok = resp.status_code == 200
                async for line in resp.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        choices = orjson.loads(line[6:]).get("choices") or ()
                        if any((c.get("delta") or {}).get("content") for c in choices):
                            first = time.perf_counter() - t0
                ok = ok and first is not None
        elapsed = time.perf_counter() - t0
        self.sent += 1
        self.errors += not ok
        return elapsed, first


BODIES = {False: body(False), True: body(True)}


@dataclass
class Cell:
    """One arm in one phase: per-call latencies, batch throughputs, CPU seconds per process."""

    latency: list[float] = field(default_factory=list)
    ttfc: list[float] = field(default_factory=list)
    calls: int = 0
    wall_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    busy: dict[int, list[int]] = field(default_factory=dict)  # per core: [busy jiffies, all jiffies]

    def add(self, result: tuple[float, float | None]) -> None:
        self.latency.append(result[0])
        if result[1] is not None:
            self.ttfc.append(result[1])


class Meter:
    """CPU seconds of each process of the bench, read between batches."""

    def __init__(self, procs: dict[str, psutil.Process]):
        self.procs = procs

    def read(self) -> dict[str, float]:
        out = {"client": time.process_time()}
        for name, proc in self.procs.items():
            t = proc.cpu_times()
            out[name] = t.user + t.system
        return out


async def batch(arm: Arm, cell: Cell, meter: Meter, workers: int, per_worker: int, stream: bool) -> None:
    """`workers` clients of the arm, each making `per_worker` calls in a row; wall time and CPU of the batch."""

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in range(per_worker):
            cell.add(await arm.call(client, stream))

    c0, b0, t0 = meter.read(), core_busy(), time.perf_counter()
    await asyncio.gather(*(worker(arm.clients[w]) for w in range(workers)))
    t1, b1, c1 = time.perf_counter(), core_busy(), meter.read()
    cell.calls += workers * per_worker
    cell.wall_s += t1 - t0
    for name in c1:
        cell.cpu[name] = cell.cpu.get(name, 0.0) + c1[name] - c0[name]
    for core in (HOP_CORE, LOAD_CORE):
        acc = cell.busy.setdefault(core, [0, 0])
        acc[0] += b1[core][0] - b0[core][0]
        acc[1] += b1[core][1] - b0[core][1]


async def phase(arms: list[Arm], meter: Meter, n: int, workers: int, per_worker: int, stream: bool) -> dict:
    """Batches alternating between the arms, the order flipped every round, until each arm made n calls."""
    cells = {arm.name: Cell() for arm in arms}
    rounds = -(-n // (workers * per_worker))
    for i in range(rounds):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            await batch(arm, cells[arm.name], meter, workers, per_worker, stream)
    return cells


async def no_keepalive(arms: list[Arm], n: int, block: int) -> dict:
    """c=1 with keep-alive off: every call opens its own connection (for the hop: CONNECT + TLS handshake)."""
    cells = {arm.name: Cell() for arm in arms}
    clients = {arm.name: arm.client(limits=httpx.Limits(max_keepalive_connections=0)) for arm in arms}
    for arm in arms:  # warm-up: imports, the hop's certificate for the host
        for _ in range(5):
            await arm.call(clients[arm.name], False)
    for i in range(-(-n // block)):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            for _ in range(min(block, n - i * block)):
                cells[arm.name].add(await arm.call(clients[arm.name], False))
    for client in clients.values():
        await client.aclose()
    return cells


async def measure(arms: list[Arm], meter: Meter, s: Settings) -> dict:
    for arm in arms:
        arm.open()
    # Warm-up: every worker's connection opened (and, through the hop, its tunnel and TLS session) before timing.
    for arm in arms:
        for stream in (False, True):
            await asyncio.gather(*(_repeat(arm, client, stream, s.warmup) for client in arm.clients))
    out: dict = {"cotenant": {}, "waited": {}, "opened": {arm.name: [arm.tcp, arm.tls] for arm in arms},
                 "reopened": {arm.name: [0, 0] for arm in arms}}  # fmt: skip
    phases = [
        ("c1", "c=1 non-stream", 1, lambda: phase(arms, meter, s.calls, 1, s.block, False)),
        ("c1s", "c=1 streams", 1, lambda: phase(arms, meter, s.calls // 2, 1, s.block, True)),
        ("c16", f"c={CONCURRENCY} non-stream", CONCURRENCY,
         lambda: phase(arms, meter, s.calls, CONCURRENCY, s.per_worker, False)),
        ("c16s", f"c={CONCURRENCY} streams", CONCURRENCY,
         lambda: phase(arms, meter, s.calls // 2, CONCURRENCY, s.per_worker // 2, True)),
    ]  # fmt: skip
    for key, label, workers, run in phases:
        print(f"{label} ...", flush=True)
        t0 = time.perf_counter()
        wait_quiet(s.quiet_wait_s)
        out["waited"][key] = time.perf_counter() - t0
        # Idle connections expire after httpx's 5 s keep-alive: a few calls per worker reopen them before timing.
        for arm in arms:
            await asyncio.gather(*(_repeat(arm, arm.clients[w], False, 3) for w in range(workers)))
        before = {arm.name: (arm.tcp, arm.tls) for arm in arms}
        cotenant = CoTenant()
        out[key] = await run()
        out["cotenant"][key] = cotenant.cores()
        for arm in arms:  # connections opened while measuring: none, when keep-alive holds
            out["reopened"][arm.name][0] += arm.tcp - before[arm.name][0]
            out["reopened"][arm.name][1] += arm.tls - before[arm.name][1]
    print("c=1 with keep-alive off (diagnostic) ...", flush=True)
    wait_quiet(s.quiet_wait_s)
    out["nka"] = await no_keepalive(arms, s.no_keepalive, 25)
    for arm in arms:
        for client in arm.clients:
            await client.aclose()
    return out


async def _repeat(arm: Arm, client: httpx.AsyncClient, stream: bool, n: int) -> None:
    for _ in range(n):
        await arm.call(client, stream)


def count_rows(db_path: Path) -> dict[str, tuple[int, int]]:
    """Per episode: (calls, calls with status ok), in a stopped proxy's database."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        rows = con.execute("SELECT episode_id, count(*), count(*) FILTER (status = 'ok') FROM calls "
                           "GROUP BY episode_id").fetchall()  # fmt: skip
    finally:
        con.close()
    return {r[0]: (r[1], r[2]) for r in rows}


# ---------------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1000:.2f}"


def _row(what: str, plain: float, hop: float, unit: str = "ms") -> str:
    if unit == "ms":
        return f"| {what} | {_ms(plain)} | {_ms(hop)} | **{(hop - plain) * 1000:+.2f}** | **{hop / plain:.2f}x** |"
    return f"| {what} | {plain:,.0f} | {hop:,.0f} | **{hop - plain:+,.0f}** | **{hop / plain:.2f}x** |"


def _latency_rows(label: str, cells: dict, key: str) -> list[str]:
    p, h = getattr(cells["plain"], key), getattr(cells["hop"], key)
    return [_row(f"{label} p50, ms", pct(p, 0.5), pct(h, 0.5)), _row(f"{label} p99, ms", pct(p, 0.99), pct(h, 0.99))]


def _rate(cell: Cell) -> float:
    return cell.calls / cell.wall_s


def _busy(cell: Cell, core: int) -> float:
    busy, total = cell.busy.get(core, (0, 0))
    return busy / max(1, total)


def _cpu_us(cell: Cell, proc: str) -> float:
    return cell.cpu.get(proc, 0.0) / cell.calls * 1e6


def table(r: dict) -> list[str]:
    c = CONCURRENCY
    rows = [
        "| measurement | plain OPENAI_BASE_URL | through the hop | added | hop / plain |",
        "| --- | ---: | ---: | ---: | ---: |",
        *_latency_rows("c=1 non-stream call", r["c1"], "latency"),
        *_latency_rows("c=1 stream, first content chunk", r["c1s"], "ttfc"),
        *_latency_rows("c=1 stream, whole stream", r["c1s"], "latency"),
        *_latency_rows(f"c={c} non-stream call", r["c16"], "latency"),
        _row(f"c={c} non-stream calls/s", _rate(r["c16"]["plain"]), _rate(r["c16"]["hop"]), "rate"),
        *_latency_rows(f"c={c} stream, first content chunk", r["c16s"], "ttfc"),
        *_latency_rows(f"c={c} stream, whole stream", r["c16s"], "latency"),
        _row(f"c={c} streams/s", _rate(r["c16s"]["plain"]), _rate(r["c16s"]["hop"]), "rate"),
        *_latency_rows("diagnostic: c=1 non-stream, keep-alive off (new connection per call)", r["nka"], "latency"),
    ]
    return rows


def cpu_table(r: dict) -> list[str]:
    """CPU per call of each process, at c=16 (non-stream, and streams), and how busy each core was."""
    procs = ("hop", "proxy", "client", "engine")
    out = ["| CPU per call, us (c=16) | " + " | ".join(procs)
           + f" | core {HOP_CORE} busy (hop, proxy) | core {LOAD_CORE} busy (client, engine) |",
           "| --- | " + " | ".join("---:" for _ in procs) + " | ---: | ---: |"]  # fmt: skip
    for key, what in (("c16", "non-stream"), ("c16s", "stream")):
        for arm in ("plain", "hop"):
            cell = r[key][arm]
            cells = ["-" if arm == "plain" and p == "hop" else f"{_cpu_us(cell, p):,.0f}" for p in procs]
            cells += [f"{_busy(cell, HOP_CORE):.0%}", f"{_busy(cell, LOAD_CORE):.0%}"]
            out.append(f"| {what}, {arm} | " + " | ".join(cells) + " |")
    return out


def report(r: dict, recorded: dict, s: Settings, argv: list[str], versions: str) -> str:
    c, ka, warm = CONCURRENCY, r["reopened"], r["opened"]
    answered = {arm: recorded[EPISODES[arm]] for arm in ("plain", "hop")}
    c16 = r["c16"]
    hop_cpu = _cpu_us(c16["hop"], "hop")
    added50 = (pct(r["c1"]["hop"].latency, 0.5) - pct(r["c1"]["plain"].latency, 0.5)) * 1000
    added99 = (pct(r["c1"]["hop"].latency, 0.99) - pct(r["c1"]["plain"].latency, 0.99)) * 1000
    cot = ", ".join(f"{k} {v:.2f} (waited {r['waited'][k]:.0f} s)" for k, v in r["cotenant"].items())
    lines = [
        "## transparent_hop",
        "",
        f"`python bench/transparent_hop.py{' ' + ' '.join(argv) if argv else ''}` on {date.today()}: {versions}.",
        "What transparent mode's hop adds to a call: (a) plain, the client at the recording proxy's "
        "`{proxy}/e/<episode>/v1` (what OPENAI_BASE_URL gives an agent); (b) hop, the same client at "
        f"`{VENDOR_URL}` through the embedded mitmproxy (proxy/mitm_addon.py under .venv-mitm), with the proxy "
        "URL and CA that `Interceptor.agent_env(episode, token)` gives (HTTPS_PROXY with the episode as "
        "credentials, SSL_CERT_FILE). Both arms go through the same recording proxy (asyncio, recording into "
        "DuckDB) to the same scripted engine (64 prompt ids, 4 answer tokens, streams 2 ms between tokens): the "
        "difference is the hop alone.",
        f"Client: httpx {httpx.__version__} AsyncClient (what the openai SDK uses; HTTP/1.1) on asyncio, one "
        "client per worker kept for the whole run, so **connections are kept alive and reused**: the warm-up "
        f"opened {warm['plain'][0]} TCP connections in the plain arm and {warm['hop'][0]} CONNECT tunnels / "
        f"{warm['hop'][1]} TLS handshakes through the hop (one per worker); all the measured calls together "
        f"opened {ka['plain'][0]} more (plain) and {ka['hop'][0]} / {ka['hop'][1]} more (hop) (each phase first "
        "re-warms its workers, since "
        "httpx closes connections idle for 5 s). The last row "
        "turns keep-alive off (a new connection per call; through the hop a new CONNECT + TLS handshake per call) "
        "to show what an agent that does not reuse connections pays.",
        f"Pinning: the proxy and the hop on core {HOP_CORE}, the engine and the client on core {LOAD_CORE}. The "
        f"arms alternate in batches (c=1: {s.block} calls; c={c}: {c} workers x {s.per_worker} calls, streams x "
        f"{s.per_worker // 2}), the order flipped every round, after a warm-up of {s.warmup} calls per worker and "
        f"arm. Calls per arm: {s.calls} non-stream and {s.calls // 2} streams at each concurrency, "
        f"{s.no_keepalive} without keep-alive. Settings: {', '.join(f'{k}={v}' for k, v in asdict(s).items())}.",
        "",
        *table(r),
        "",
        f"CPU per call of each process at c={c}, and how busy each core was (share of the batches' wall time):",
        "",
        *cpu_table(r),
        "",
        f"- Added per call at c=1: **{added50:+.2f} ms p50, {added99:+.2f} ms p99**. The field: mitmproxy measured "
        "~+3 ms median per call on this machine kind (../shared/notes/engines-and-stores.md); a Python LiteLLM "
        "proxy adds +4.3 ms p50 / +9.8 ms p99 at c=1 (a whole proxy, not only a hop). The hop comes on top of the "
        "recording proxy's own cost (docs/BENCHMARKS.md, proxy_overhead).",
        f"- CPU: the hop spends ~{hop_cpu:,.0f} us per non-stream call at c={c} (mitmproxy is pure Python: TLS, "
        f"HTTP parsing, its flow objects), {hop_cpu / _cpu_us(c16['plain'], 'proxy'):.1f}x what the recording "
        f"proxy spends on a call; one core of hop alone would carry at most ~{1e6 / hop_cpu:,.0f} calls/s. The "
        f"proxy's own CPU a call is {_cpu_us(c16['hop'], 'proxy') - _cpu_us(c16['plain'], 'proxy'):+,.0f} us "
        "higher in the hop arm (it shares its core with the hop), and the agent's own process spends "
        f"{_cpu_us(c16['hop'], 'client') - _cpu_us(c16['plain'], 'client'):+,.0f} us more (TLS to the hop). At c={c} "
        f"the hop and the proxy share core {HOP_CORE}: {_busy(c16['hop'], HOP_CORE):.0%} busy through the hop, "
        f"the limit on that arm's throughput (a machine with a core to spare for the hop would carry more); the "
        f"plain arm left it {_busy(c16['plain'], HOP_CORE):.0%} busy and was held by core {LOAD_CORE} (httpx "
        f"client and engine, {_busy(c16['plain'], LOAD_CORE):.0%} busy), so its calls/s are the client's limit, "
        "not the proxy's (docs/BENCHMARKS.md, proxy_overhead, has the proxy's own).",
        "- Recorded rows (status ok) / calls answered, per arm: "
        + ", ".join(f"{arm} {answered[arm][1]:,} / {r['sent'][arm]:,}" for arm in ("plain", "hop"))
        + "; errors: " + ", ".join(f"{arm} {r['errors'][arm]}" for arm in ("plain", "hop")) + ".",
        f"- CPU used by processes outside this benchmark, in cores (of {os.cpu_count()}), per phase: {cot}.",
    ]
    disturbed = [k for k, v in r["cotenant"].items() if v > 0.2]
    if disturbed:
        lines.append(f"- **Disturbed phases** (other processes used > 0.2 cores): {', '.join(disturbed)}; the "
                     "arms alternate, so both saw it, but their tails measure the machine's other load too.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=Settings.calls,
                        help="non-stream calls per arm at each concurrency (streams: half as many)")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    s = Settings(calls=args.calls, no_keepalive=min(Settings.no_keepalive, max(25, args.calls // 10)))
    argv = [f"--calls {args.calls}"] if args.calls != Settings.calls else []
    mitm = mitm_python()  # fails early, with what to do, where .venv-mitm is missing
    if len(os.sched_getaffinity(0)) < 2:
        print("warning: fewer than 2 cores; every process shares one", file=sys.stderr)
    children: list[Child] = []
    interceptor = None
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        db = tmp / "rec.duckdb"
        try:
            engine = Child(engine_main, LOAD_CORE).ready()
            children.append(engine)
            proxy = Child(proxy_main, HOP_CORE, engine.served, str(db), "asyncio", {}, None).ready()
            children.append(proxy)
            interceptor, hop = start_hop(proxy.served, tmp / "home")
            pin(LOAD_CORE)  # the client: this process
            env = interceptor.agent_env(EPISODES["hop"], EPISODE_TOKEN)
            verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
            arms = [Arm("plain", f"{proxy.served}/e/{EPISODES['plain']}/v1", {}),
                    Arm("hop", VENDOR_URL, {"proxy": env["HTTPS_PROXY"], "verify": verify})]  # fmt: skip
            meter = Meter({"hop": hop, "proxy": proxy.ps, "engine": engine.ps})
            results = run_loop(measure(arms, meter, s), "asyncio")
            results["sent"] = {arm.name: arm.sent for arm in arms}
            results["errors"] = {arm.name: arm.errors for arm in arms}
        finally:
            if interceptor is not None:
                interceptor.close()
            for child in reversed(children):
                child.stop()  # the proxy flushes on SIGTERM; only then can its database be opened
        recorded = count_rows(db)
    versions = (f"`nproc` {os.cpu_count()}, Python {platform.python_version()}, httpx {httpx.__version__}, "
                f"mitmproxy {_mitm_version(mitm)} (Python of .venv-mitm), DuckDB {duckdb.__version__}, "
                f"{platform.machine()}")  # fmt: skip
    text = report(results, recorded, s, argv, versions)
    print(text)
    if not args.no_docs:
        write_section("transparent_hop", text)
        print(f"updated {DOCS}")


def _mitm_version(python: str) -> str:
    done = subprocess.run([python, "-c", "from mitmproxy.version import VERSION; print(VERSION)"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    main()
