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
import platform
import pstats
import signal
import subprocess
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.docs_section import DOCS, write_section  # noqa: E402
from bench.hops import (  # noqa: E402
    COMPLETION_TOKENS,
    ENGINES,
    LOAD_CORE,
    PROMPT_TOKENS,
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
from bench.loadgen import client_blocks, client_load, mean, pct  # noqa: E402
from proxy import ProxyConfig  # noqa: E402
from proxy.request import CHAT, prepare  # noqa: E402

try:
    import uvloop
except ImportError:  # the stdlib loop still gives every number but the uvloop column
    uvloop = None

LOOPS = ("asyncio", "uvloop") if uvloop else ("asyncio",)
GOAL_CALLS_S = 3500  # recorded calls/s on one pinned core at c=64: half the aiohttp byte-relay floor
DEFERRED = {"record_batch": 10**9, "record_delay_s": 10**6}  # the recorder writes only at shutdown
# proxy name: (event loop, engine, config overrides)
PROXIES = {f"{loop}-{engine}": (loop, engine, {}) for loop in LOOPS for engine in ENGINES} | {
    "deferred": ("asyncio", "fast", DEFERRED)
}
BEFORE = "before"  # the proxy of --before PATH: asyncio, fast engine


@dataclass(frozen=True)
class Settings:
    latency_n: int = 2000  # non-stream requests per path at c=1
    ttft_n: int = 500  # streams per path at c=1 (trickle engine, ~5 ms each)
    burst_n: int = 1000  # 32-chunk streams per path at c=1 (fast engine: all chunks at once)
    block: int = 250  # c=1 requests per path in a row
    settle_s: float = 0.3  # pause after each c=1 block: longer than the recorder's 0.2 s batch delay
    warmup_n: int = 100  # c=1 requests per path before measuring
    concurrency: int = 64
    rounds: int = 3  # c=64 windows per path, rotating over the paths
    window_s: float = 4.0  # measured part of each window
    warmup_s: float = 0.5  # load before each window's measured part
    stream_concurrency: int = 50
    streams_per_client: int = 5  # paced streams (32 chunks, 20 ms apart) per client and path, after one warm-up
    profile_s: float = 4.0
    quiet_wait_s: float = 15.0  # before each phase, wait up to this long for co-tenants to go quiet


QUICK = Settings(latency_n=400, ttft_n=100, burst_n=150, block=100, warmup_n=30, rounds=1, window_s=2.0,
                 streams_per_client=1, profile_s=2.0, quiet_wait_s=2.0)  # fmt: skip


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


def answered(r: dict) -> dict[str, int]:
    """Calls each proxy answered, from the load generator's counts."""
    out = {"deferred": r["lat"]["deferred"]["sent"]}
    if BEFORE in r["lat"]:
        out[BEFORE] = r["lat"][BEFORE]["sent"] + r["tput"][BEFORE]["sent"]
    for loop in LOOPS:
        out[f"{loop}-fast"] = sum(r[k][loop]["sent"] for k in ("lat", "burst", "tput"))
        out[f"{loop}-trickle"] = r["ttft"][loop]["sent"]
        out[f"{loop}-paced"] = r["streams"][loop]["sent"]
    return out


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


def ms(x: float) -> str:
    return f"{x * 1000:.3f}"


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def _added(res: dict, path: str, key: str, q: float) -> tuple[str, float]:
    """`value (+added)` of a path at quantile q, against direct."""
    added = pct(res[path][key], q) - pct(res["direct"][key], q)
    return f"{ms(pct(res[path][key], q))} (**{added * 1000:+.3f}**)", added


def _row(what: str, goal: str, direct: str, relay: str, per_loop: list[str], met: list[bool | None]) -> str:
    cells = [what, goal, direct, relay, *per_loop, " / ".join(_met(m) for m in met) or "-"]
    return "| " + " | ".join(cells) + " |"


def _latency_row(what: str, goal: str, res: dict, key: str, q: float, limit: float | None) -> str:
    """Added = path minus direct at quantile q; the relay, where measured, is the floor."""
    relay = _added(res, "relay", key, q)[0] if "relay" in res else "-"
    cells = [_added(res, loop, key, q) for loop in LOOPS]
    met = [None if limit is None else added <= limit for _, added in cells]
    return _row(what, goal, ms(pct(res["direct"][key], q)), relay, [text for text, _ in cells], met)


def _gap_row(what: str, res: dict, q: float) -> str:
    base = pct(res["direct"]["gaps"], q)
    ratios = [pct(res[loop]["gaps"], q) / base for loop in LOOPS]
    cells = [f"{ms(base * ratio)} (**{ratio:.2f}x**)" for ratio in ratios]
    return _row(what, "0.9..1.1x", ms(base), "-", cells, [0.9 <= ratio <= 1.1 for ratio in ratios])


def table(r: dict, recorded: dict[str, tuple[int, int, int]], s: Settings) -> list[str]:
    """The results: one row a measurement, one column a path."""
    tput, lat = r["tput"], r["lat"]
    rate = {path: mean(tput[path]["calls_per_s"]) for path in tput}
    loop_cpu = {p: mean(tput[p]["hop_loop_cpu"]) / rate[p] * 1e6 for p in ("relay", *LOOPS)}
    other_cpu = {p: mean(tput[p]["hop_other_cpu"]) / rate[p] * 1e6 for p in ("relay", *LOOPS)}
    capacity = {p: 1e6 / (loop_cpu[p] + other_cpu[p]) for p in ("relay", *LOOPS)}
    ok = {loop: all(rows == n_ok == n for name, (rows, n_ok, n) in recorded.items() if _loop_of(name) == loop)
          for loop in LOOPS}  # fmt: skip
    deferred = " / ".join(_added(lat, "deferred", "latency", q)[0] for q in (0.5, 0.99))
    c, sc, st = s.concurrency, s.stream_concurrency, r["streams"]
    # fmt: off
    return [
        "| measurement | goal | direct | byte relay (floor) | " + " | ".join(f"proxy, {k}" for k in LOOPS)
        + f" | goal met ({' / '.join(LOOPS)}) |",
        "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in LOOPS) + " | --- |",
        _latency_row("c=1 non-stream latency p50, ms", "<= +0.4", lat, "latency", 0.5, 0.0004),
        _latency_row("c=1 non-stream latency p99, ms", "<= +1.5", lat, "latency", 0.99, 0.0015),
        _row("c=1 p50 / p99 via an asyncio proxy writing only at shutdown (diagnostic), ms", "-", "-", "-",
             [deferred] + ["-"] * (len(LOOPS) - 1), []),
        _row(f"c={c} calls/s", f">= {GOAL_CALLS_S:,}, all recorded", f"{rate['direct']:,.0f}", f"{rate['relay']:,.0f}",
             [f"**{rate[k]:,.0f}**" for k in LOOPS], [rate[k] >= GOAL_CALLS_S and ok[k] for k in LOOPS]),
        _row(f"c={c} hop CPU a call: loop thread + other threads (recorder, DuckDB), us", "-", "-",
             f"{loop_cpu['relay']:.0f} + {other_cpu['relay']:.0f}",
             [f"{loop_cpu[k]:.0f} + {other_cpu[k]:.0f}" for k in LOOPS], []),
        _row(f"c={c} garbage collection: share of the proxy's CPU", "-", "-", "-",
             [f"{mean(tput[k]['hop_gc_cpu']) / (mean(tput[k]['hop_loop_cpu']) + mean(tput[k]['hop_other_cpu'])):.0%}"
              for k in LOOPS], []),
        _row("calls/s one full core of the hop carries (1 / CPU a call)", f">= {GOAL_CALLS_S:,}", "-",
             f"{capacity['relay']:,.0f}", [f"**{capacity[k]:,.0f}**" for k in LOOPS],
             [capacity[k] >= GOAL_CALLS_S for k in LOOPS]),
        _row("rows in `calls` (status ok) / calls answered, all phases", "all", "-", "-",
             [_recorded(recorded, k) for k in LOOPS], [ok[k] for k in LOOPS]),
        _latency_row("c=1 time to first content chunk p50, ms (2 ms/token)", "<= +1", r["ttft"], "ttft", 0.5, 0.001),
        _latency_row("c=1 time to first content chunk p99, ms", "-", r["ttft"], "ttft", 0.99, None),
        _latency_row("c=1 32-chunk stream arriving at once, whole stream p50, ms", "-", r["burst"], "latency", 0.5,
                     None),
        _latency_row(f"c={sc} time to first content chunk p50, ms (20 ms/token)", "-", st, "ttft", 0.5, None),
        _row(f"c={sc} streams: proxy CPU share; CPU a streamed chunk", "-", "-", "-",
             [_stream_cpu(st[k]) for k in LOOPS], []),
        _gap_row(f"c={sc} inter-chunk gap p50, ms", st, 0.5),
        _gap_row(f"c={sc} inter-chunk gap p99, ms", st, 0.99),
    ]
    # fmt: on


def _stream_cpu(res: dict) -> str:
    chunks = res["sent"] * (ENGINES["paced"].completion_tokens + 2)  # + the role chunk and [DONE]
    return f"{res['hop_cpu']:.0%}; {res['hop_cpu_s'] / chunks * 1e6:.0f} us"


def _recorded(recorded: dict[str, tuple[int, int, int]], loop: str) -> str:
    n_ok = sum(v[1] for name, v in recorded.items() if _loop_of(name) == loop)
    n = sum(v[2] for name, v in recorded.items() if _loop_of(name) == loop)
    return f"{n_ok:,} / {n:,}"


def _loop_of(proxy_name: str) -> str:
    return PROXIES[proxy_name][0] if proxy_name in PROXIES else proxy_name


def before_table(r: dict, recorded: dict[str, tuple[int, int, int]], label: str, s: Settings) -> list[str]:
    """--before: the earlier commit's proxy (asyncio, as it ran then) and this tree's on each loop (uvloop is what
    this tree runs by default), measured in the same phases."""
    lat, tput, cells = r["lat"], r["tput"], {}
    for path in (BEFORE, *LOOPS):
        rate = mean(tput[path]["calls_per_s"])
        cpu = (mean(tput[path]["hop_loop_cpu"]) + mean(tput[path]["hop_other_cpu"])) / rate * 1e6
        rows, n_ok, n = recorded[BEFORE if path == BEFORE else f"{path}-fast"]
        cells[path] = [_added(lat, path, "latency", q)[0] for q in (0.5, 0.99)] + [
            f"**{rate:,.0f}**", f"{cpu:.0f}", f"{1e6 / cpu:,.0f}", f"{n_ok:,} / {n:,}"]
    what = ["c=1 non-stream latency p50, ms (added over direct)", "c=1 non-stream latency p99, ms",
            f"c={s.concurrency} calls/s (the proxy on one core)", f"c={s.concurrency} hop CPU a call, us",
            "calls/s one full core of the hop carries", "rows in `calls` (status ok) / calls answered"]
    head = f"| measurement | proxy before ({label}), asyncio | " + " | ".join(
        f"proxy now, {loop}{' (the default)' if loop == 'uvloop' else ''}" for loop in LOOPS) + " |"
    return [head, "| --- |" + " ---: |" * (1 + len(LOOPS)),
            *(f"| {w} | " + " | ".join(cells[path][i] for path in (BEFORE, *LOOPS)) + " |"
              for i, w in enumerate(what))]


def _revision(path: str) -> str:
    out = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or Path(path).name


def limits(r: dict, s: Settings) -> list[str]:
    """Which core was the limit in each c=64 window: each process's share of its core, and the co-tenants'."""
    lines = []
    for path, t in r["tput"].items():
        busy0, busy1 = mean(t["core0"]), mean(t["core1"])
        hop = mean(t["hop_loop_cpu"]) + mean(t["hop_other_cpu"])
        load = mean(t["engine_cpu"]) + mean(t["client_cpu"])
        hop_text = (f"{path} loop thread {mean(t['hop_loop_cpu']):.0%} + other threads {mean(t['hop_other_cpu']):.0%}"
                    if path != "direct" else "idle")  # fmt: skip
        lines.append(
            f"- {path}: {' / '.join(f'{v:,.0f}' for v in t['calls_per_s'])} calls/s in {s.rounds} window(s). "
            f"Core 0 {busy0:.0%} busy ({hop_text}, others {max(0.0, busy0 - hop):.0%}; {_bound(busy0)}); "
            f"core 1 {busy1:.0%} busy (engine {mean(t['engine_cpu']):.0%}, load generator "
            f"{mean(t['client_cpu']):.0%}, others {max(0.0, busy1 - load):.0%}; {_bound(busy1)}). "
            f"Latency p50 {ms(pct(t['latency'], 0.5))} ms, p99 {ms(pct(t['latency'], 0.99))} ms."
        )
    cot = ", ".join(f"{k} {v:.2f} (waited {r['waited'][k]:.0f} s)" for k, v in r["cotenant"].items())
    lines.append(f"- CPU used by processes outside this benchmark, in cores (of {os.cpu_count()}), per phase: {cot}.")
    disturbed = [k for k, v in r["cotenant"].items() if v > 0.2]
    if disturbed:
        lines.append(f"- **Disturbed phases** (other processes used > 0.2 cores): {', '.join(disturbed)}; their rows "
                     "measure the machine's other load as much as the proxy. Rerun on a quiet machine.")  # fmt: skip
    return lines


def _bound(busy: float) -> str:
    return "**saturated: the limit**" if busy >= 0.9 else "not saturated"


def report(r: dict, recorded: dict, s: Settings, quick: bool, prof_rate: float, shares: dict[str, float],
           before: str | None) -> str:
    versions = (f"`nproc` {os.cpu_count()}, Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
                f"uvloop {uvloop.__version__ if uvloop else 'absent'}, DuckDB {duckdb.__version__}, "
                f"{platform.machine()}")  # fmt: skip
    engines = "; ".join(
        f"{n}: {e.completion_tokens} tokens, chunk_delay_s={e.chunk_delay_s}" for n, e in ENGINES.items()
    )
    return "\n".join(
        [
            "## proxy_overhead",
            "",
            f"`python bench/proxy_overhead.py{' --quick' if quick else ''}{' --before PATH' if before else ''}` on "
            f"{date.today()}: {versions}.",
            f"Each hop (proxy, relay) alone on core {PROXY_CORE} in its own process (event loop, recorder thread "
            "and DuckDB share it); scripted engine (uvloop) and load generator (raw keep-alive HTTP/1.1 on uvloop) "
            f"on core {LOAD_CORE}, each in its own process. Chat calls: ~2 kB request; the engine answers "
            f"{PROMPT_TOKENS} prompt ids + {COMPLETION_TOKENS} tokens with logprobs; recording on (batches of "
            f"{ProxyConfig.record_batch} calls or {ProxyConfig.record_delay_s} s). Direct requests carry the body "
            "the proxy sends upstream. Cells: value (added over direct, "
            "or proxy / direct). The byte relay copies bytes and parses nothing: the floor any extra process hop "
            "pays on this pinning (direct: client and engine share core 1; a hop adds four cross-core wake-ups). "
            "LiteLLM for scale: +4.3 ms p50, +9.8 ms p99 at c=1, ~180 calls/s.",
            f"Settings: {', '.join(f'{k}={v}' for k, v in asdict(s).items())}. Engines: {engines}.",
            "",
            *table(r, recorded, s),
            "",
            *([f"Before and after (`--before`: commit {before}'s proxy in the c=1 latency and c={s.concurrency} "
               "throughput phases beside this tree's, same core, same run):", "",
               *before_table(r, recorded, before, s), ""] if before else []),
            f"What limited the c={s.concurrency} windows (share of one core, sampled during each measured window):",
            "",
            *limits(r, s),
            f"- Where an asyncio proxy's loop thread spends its CPU at c={s.concurrency} (cProfile on thread CPU "
            f"time, {prof_rate:,.0f} calls/s while profiled; the rest is the aiohttp server and the event loop): "
            + "; ".join(f"{part} {share:.0%}" for part, share in shares.items())
            + ". The script prints the top 15.",
        ]
    )


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
                  _revision(args.before) if args.before else None)
    print(text)
    print("\ncProfile of the proxy's loop thread under load (CPU time):\n" + prof_text)
    if not args.no_docs:
        write_section("proxy_overhead", text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
