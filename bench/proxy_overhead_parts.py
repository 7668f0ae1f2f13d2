"""What bench/proxy_overhead.py runs and how it reports: the proxies under test and the run's settings, then its
results as tables for the console and docs/BENCHMARKS.md (the measuring stays in proxy_overhead.py)."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import aiohttp
import duckdb

from bench.hops import COMPLETION_TOKENS, ENGINES, LOAD_CORE, PROMPT_TOKENS, PROXY_CORE
from bench.loadgen import mean, pct
from proxy import ProxyConfig

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


# ---------------------------------------------------------------------------------------------------------------
# The report.
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


def revision(path: str) -> str:
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
