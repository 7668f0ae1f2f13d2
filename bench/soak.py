"""Load soak: many concurrent agents for a bounded time through `harness serve` against the scripted engine.

Every call must be accounted for three times over, exactly: the calls the agents saw answered (a 200, and for a
stream every chunk up to [DONE]), the calls recorded in DuckDB (`calls`, status 'ok', none of another status),
and the chat/completions requests the scripted engine served (counted per episode on the engine's side, from the
`X-Harness-Episode` header the proxy sends with every engine call). Per episode, the recorded call indexes are
0..n-1 with no gap or duplicate. Meanwhile the proxy process's RSS is sampled every second: after the warm-up
(the first quarter of the run, or longer until the agents have been answered twice each on average, as on a loaded
machine; half of the run at most) it must stay flat.

The proxy runs as its own process (`python -m harness.cli serve --upstream <engine> --port 0`, stopped with
SIGINT as a user would); the scripted engine and the agents share one event loop in this process. Each agent
plays episodes of 2-8 turns (`/e/<episode>/v1`), a random mix of streamed and whole answers, with short random
think times, echoing each reply into its next request as a real agent does; now and then it makes a side call in
the same episode at the same time (two calls of one episode in flight, also as its first calls). The engine is
given a `/tokenize` route with a toy chat template, so the continued turns take the proxy's token-exact path
(`/v1/completions` on spliced ids) as they do against vLLM, and its per-episode state (proxy/continuity.py) fills
up and is evicted.

    .venv/bin/python bench/soak.py --agents 256 --seconds 600 [--report soak.json]

tests/proxy/test_soak.py runs the same soak for ~20 s (HARNESS_SOAK_SECONDS) in the fast tier.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import duckdb
import orjson

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench.loadgen import pct, run_loop  # noqa: E402
from bench.soak_parts import DB_MEMORY_MB, EPISODE_PREFIX, ProxyProcess, SoakEngine, cpu_s, rss_kb  # noqa: E402
from proxy.scripted_engine import Script  # noqa: E402

WARMUP_SHARE = 0.25  # the first quarter of the run fills the proxy's bounded state; RSS must be flat after it
WARMUP_CALLS_PER_AGENT = 2  # ...and every agent has been answered twice on average, however slow the machine
WARMUP_MAX_SHARE = 0.5  # the warm-up ends by half-way, even on a machine too loaded to get there
# Allowed growth of the proxy's RSS from the end of the warm-up to the end (measurements: tests/proxy/test_soak.py):
RSS_BOUND_MB = 100.0  # in all: DuckDB's rows not yet checkpointed (<= its 64 MB threshold), timelines filling, slack
OUTSIDE_DUCKDB_BOUND_MB = 60.0  # less the growth of DuckDB's buffer memory (by its own count): the proxy's own state


# ---------------------------------------------------------------------------------------------------------------
# The agents.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class AgentStats:
    answered: Counter = field(default_factory=Counter)  # episode -> calls answered in full
    latencies: list = field(default_factory=list)  # seconds, every answered call
    streamed: int = 0
    whole: int = 0
    errors: list = field(default_factory=list)  # (episode, what), every call not answered in full
    last_answer: float = 0.0  # monotonic time of the last answer
    answer_times: list = field(default_factory=list)  # monotonic time of every answer


async def _call(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[str | None, str | None]:
    """(reply text, None) when answered in full; (None, what went wrong) otherwise."""
    async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            return None, f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
        if not body.get("stream"):
            data = orjson.loads(await resp.read())
            return data["choices"][0]["message"]["content"] or "", None
        parts, done = [], False
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            chunk = orjson.loads(payload)
            if "error" in chunk:
                return None, f"error event: {chunk['error']}"
            for choice in chunk.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
        return ("".join(parts), None) if done else (None, "the stream ended without [DONE]")


async def _answered(session: aiohttp.ClientSession, url: str, body: dict, episode: str,
                    stats: AgentStats) -> str | None:
    """One call, counted: its reply text when answered in full, else None (and the error noted)."""
    t0 = time.perf_counter()
    try:
        text, error = await _call(session, url, body)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        text, error = None, f"{type(exc).__name__}: {exc}"
    if error is not None:
        stats.errors.append((episode, error))
        return None
    stats.latencies.append(time.perf_counter() - t0)
    stats.answered[episode] += 1
    stats.last_answer = time.monotonic()
    stats.answer_times.append(stats.last_answer)
    if body.get("stream"):
        stats.streamed += 1
    else:
        stats.whole += 1
    return text


def _body(messages: list[dict], rng: random.Random) -> dict:
    body = {"model": "gpt-4o-mini", "messages": messages, "max_tokens": 16, "temperature": 0.7}
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


async def agent(number: int, session: aiohttp.ClientSession, base: str, deadline: float, stats: AgentStats,
                rng: random.Random, think_s: float, side_share: float = 0.15) -> None:
    """Episodes of 2-8 turns until the deadline; the call in flight at the deadline is finished, not dropped.

    In `side_share` of the turns the agent also makes a side call in the same episode, at the same time (a
    sub-agent, a parallel tool): two calls of one episode in flight together, also as an episode's first calls.
    """
    episode_no, failures = 0, 0
    await asyncio.sleep(rng.uniform(0, think_s))  # agents start spread out, not in lockstep
    while time.monotonic() < deadline and failures < 3:  # an agent gives up after 3 failed calls in a row
        episode = f"{EPISODE_PREFIX}{number}-{episode_no}"
        episode_no += 1
        url = f"{base}/e/{episode}/v1/chat/completions"
        messages = [{"role": "system", "content": f"You are soak agent {number}. Answer briefly."},
                    {"role": "user", "content": f"Task {episode_no}: list some words."}]
        for turn in range(rng.randint(2, 8)):
            if time.monotonic() >= deadline:
                break
            main = _answered(session, url, _body(messages, rng), episode, stats)
            if rng.random() < side_share:
                side = [*messages[:1], {"role": "user", "content": f"Side question {turn}: one word?"}]
                text, side_text = await asyncio.gather(main, _answered(session, url, _body(side, rng), episode,
                                                                       stats))
                text = None if side_text is None else text
            else:
                text = await main
            if text is None:
                failures += 1
                break  # this episode is spoilt; the agent starts another
            failures = 0
            messages = [*messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": f"Turn {turn + 2}: more words please."}]
            await asyncio.sleep(rng.uniform(0, think_s))


# ---------------------------------------------------------------------------------------------------------------
# One soak run.
# ---------------------------------------------------------------------------------------------------------------


async def _end_warmup(proxy: ProxyProcess, session: aiohttp.ClientSession, t0: float, seconds: float,
                      calls: int, stats: AgentStats, out: dict) -> None:
    """The warm-up ends at the first quarter of the run, or later, once `calls` calls have been answered (a loaded
    machine ramps 256 agents up slower: their connections and the proxy's per-episode state are still growing),
    and by half-way at the latest. Then DuckDB's buffer memory is read, to be taken off the RSS growth."""
    await asyncio.sleep(t0 + seconds * WARMUP_SHARE - time.monotonic())
    while sum(stats.answered.values()) < calls and time.monotonic() < t0 + seconds * WARMUP_MAX_SHARE:
        await asyncio.sleep(0.05)
    out["warmup_end_at_s"] = round(time.monotonic() - t0, 2)
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        out["warmup_end"] = await proxy.duckdb_memory_mb(session)


async def _written(proxy: ProxyProcess, session: aiohttp.ClientSession, timeout_s: float = 60.0) -> int | None:
    """Wait until the recorder has written everything it took; the records pending when the agents were done."""
    deadline, first = time.monotonic() + timeout_s, None
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        while (n := await proxy.pending_records(session)) and time.monotonic() < deadline:
            first = n if first is None else first
            await asyncio.sleep(0.1)
        return first or 0
    return None


async def _sample_rss(pid: int, t0: float, samples: list, period_s: float = 1.0) -> None:
    """RSS of `pid` at t0, t0 + 1 s, t0 + 2 s, ... (a busy loop may sample late, never twice in one period)."""
    k = 0
    while (kb := rss_kb(pid)) is not None:
        samples.append((round(time.monotonic() - t0, 2), kb))
        k = max(k + 1, int((time.monotonic() - t0) / period_s) + 1)
        await asyncio.sleep(t0 + k * period_s - time.monotonic())


def _recorded(db: Path) -> dict:
    con = duckdb.connect(str(db), read_only=True)
    try:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        return {
            "by_status": dict(q("SELECT status, count(*) FROM calls GROUP BY 1")),
            "episodes": {e: (n, lo, hi, distinct) for e, n, lo, hi, distinct in q(
                "SELECT episode_id, count(*), min(call_index), max(call_index), count(DISTINCT call_index) "
                "FROM calls GROUP BY 1")},
            "ok_by_episode": dict(q("SELECT episode_id, count(*) FROM calls WHERE status = 'ok' GROUP BY 1")),
            "errors": q("SELECT episode_id, call_index, status, http_status, error FROM calls "
                        "WHERE status <> 'ok' ORDER BY started_at LIMIT 10"),
            "continuity": {f"{mode}/{reason}" if reason else mode: n for mode, reason, n in q(
                "SELECT extra->'continuity'->>'mode', extra->'continuity'->>'reason', count(*) FROM calls "
                "GROUP BY ALL ORDER BY 3 DESC")},
            "streamed": q("SELECT count(*) FILTER (WHERE stream) FROM calls")[0][0],
            "episode_rows": q("SELECT count(*) FROM episodes WHERE episode_id LIKE 'soak-%'")[0][0],
            "runs_ended": q("SELECT count(*) FILTER (WHERE ended_at IS NOT NULL), count(*) FROM runs")[0],
        }
    finally:
        con.close()


async def soak(agents: int, seconds: float, workdir: Path, *, seed: int = 0, think_s: float = 0.1,
               script: Script | None = None, drain_timeout_s: float = 60.0, progress: bool = False) -> dict:
    """Run the soak; returns its figures and everything the checks in `problems` look at."""
    workdir.mkdir(parents=True, exist_ok=True)
    db = workdir / "soak.duckdb"
    engine = SoakEngine(script or Script(prompt_tokens=32, completion_tokens=16, delay_s=0.005,
                                         chunk_delay_s=0.001))
    upstream = await engine.engine.start()
    try:
        proxy = await ProxyProcess.start(upstream, db, workdir / "run")
    except BaseException:
        await engine.engine.stop()
        raise
    probes = engine.received  # `harness serve` probes the engine once (one chat call) when it attaches
    stats, rss = AgentStats(), []
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=2 * agents + 4)  # an agent has at most two calls in flight
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120, sock_read=60))
    t0 = time.monotonic()
    deadline = t0 + seconds
    sampler = asyncio.create_task(_sample_rss(proxy.pid, t0, rss))
    duck: dict = {}
    duck_probe = asyncio.create_task(_end_warmup(proxy, session, t0, seconds, WARMUP_CALLS_PER_AGENT * agents,
                                                 stats, duck))
    cpu0 = cpu_s(proxy.pid)
    hung, backlog = 0, None
    try:
        tasks = [asyncio.create_task(agent(i, session, proxy.url, deadline, stats, random.Random(rng.random()),
                                           think_s)) for i in range(agents)]
        ticker = asyncio.create_task(_progress(t0, seconds, stats, rss)) if progress else None
        done, pending = await asyncio.wait(tasks, timeout=seconds + drain_timeout_s)
        hung = len(pending)  # calls still unanswered long after the deadline
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                stats.errors.append(("agent", repr(task.exception())))
        if ticker is not None:
            ticker.cancel()
        t_drained = time.monotonic()
        backlog = await _written(proxy, session)  # a loaded machine's recorder may still be writing: not a leak
        t_end = time.monotonic()
        await asyncio.sleep(max(0.0, 1.0 - (t_end - t0) % 1.0) + 0.05)  # one more RSS sample, idle
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            duck["end"] = await proxy.duckdb_memory_mb(session)
    finally:
        duck_probe.cancel()
        await session.close()
        cpu1 = cpu_s(proxy.pid)
        died = proxy.proc.returncode  # None: still serving, as it should be
        sampler.cancel()
        code, stop_s = await proxy.stop()
        await engine.engine.stop()
    recorded = _recorded(db)
    answered = sum(stats.answered.values())
    elapsed = max(stats.last_answer, t0 + 1e-9) - t0
    quarters = Counter(min(3, int(4 * (t - t0) / seconds)) for t in stats.answer_times)
    warm_at = duck.pop("warmup_end_at_s", seconds * WARMUP_SHARE)
    after_warmup = sum(1 for t in stats.answer_times if t - t0 >= warm_at)
    warm = min(rss, key=lambda s: abs(s[0] - warm_at)) if rss else (0, 0)
    end = rss[-1] if rss else (0, 0)  # after the drain, the proxy still up
    duck_mb = round(sum(duck.get("end", {}).values()) - sum(duck.get("warmup_end", {}).values()), 1)
    return {
        "agents": agents, "seconds": seconds, "elapsed_s": round(t_drained - t0, 2),
        "calls_answered": answered, "calls_recorded_ok": recorded["by_status"].get("ok", 0),
        "calls_recorded": sum(recorded["by_status"].values()), "recorded_by_status": recorded["by_status"],
        "engine_served": sum(engine.served.values()), "engine_received": engine.received - probes,
        "engine_served_by_route": dict(engine.served_by_route), "engine_tokenize_calls": engine.tokenized,
        "episodes": len(stats.answered), "streamed": stats.streamed, "whole": stats.whole,
        "recorded_streamed": recorded["streamed"], "episode_rows": recorded["episode_rows"],
        "calls_per_s": round(answered / elapsed, 1),
        "calls_per_s_by_quarter": [round(quarters[q] / (seconds / 4), 1) for q in range(4)],
        "latency_ms": {"p50": round(pct(stats.latencies, 0.5) * 1e3, 1),
                       "p99": round(pct(stats.latencies, 0.99) * 1e3, 1),
                       "max": round(max(stats.latencies, default=float("nan")) * 1e3, 1)},
        "pending_records_at_drain": backlog,
        "agent_errors": len(stats.errors), "agent_error_examples": stats.errors[:10], "hung_agents": hung,
        "recorded_errors": recorded["errors"],
        "continuity": recorded["continuity"],
        "rss_warmup_end_mb": round(warm[1] / 1024, 1), "rss_warmup_end_at_s": warm[0],
        "rss_end_mb": round(end[1] / 1024, 1), "rss_end_at_s": end[0],
        "rss_growth_mb": round((end[1] - warm[1]) / 1024, 1),
        "rss_growth_kb_per_call": round((end[1] - warm[1]) / max(after_warmup, 1), 2),
        "rss_peak_mb": round(max((kb for _, kb in rss), default=0) / 1024, 1),
        "rss_samples_mb": [(t, round(kb / 1024, 1)) for t, kb in rss],
        "duckdb_mb": duck,  # DuckDB's buffer memory by tag, at the warm-up's end and at the end
        "duckdb_growth_mb": duck_mb,
        "rss_growth_outside_duckdb_mb": round((end[1] - warm[1]) / 1024 - duck_mb, 1),
        "proxy_cpu_share": round((cpu1 - cpu0) / (t_drained - t0), 2) if cpu0 is not None and cpu1 else None,
        "proxy_died_with": died, "proxy_exit_code": code, "proxy_stop_s": round(stop_s, 2),
        "proxy_log_problems": [line for line in proxy.log if re.search(r"Traceback|ERROR|error|exception", line)
                               and "recording into" not in line][:20],
        "spill_file": (db.with_name(db.name + ".spill.jsonl")).exists(),
        "runs_ended": list(recorded["runs_ended"]),
        "_per_episode": {"answered": stats.answered, "served": engine.served, "recorded": recorded["episodes"],
                         "recorded_ok": recorded["ok_by_episode"]},
    }


async def _progress(t0: float, seconds: float, stats: AgentStats, rss: list) -> None:
    while True:
        await asyncio.sleep(max(5.0, seconds / 20))
        mb = rss[-1][1] / 1024 if rss else float("nan")
        print(f"  t={time.monotonic() - t0:6.0f} s  answered={sum(stats.answered.values()):8d}  "
              f"errors={len(stats.errors)}  proxy RSS={mb:.1f} MB", file=sys.stderr, flush=True)


def run_soak(agents: int = 256, seconds: float = 20.0, workdir: Path | None = None, **kwargs) -> dict:
    """The soak on a fresh event loop (uvloop when installed), in `workdir` or a temporary directory."""
    if workdir is not None:
        return run_loop(soak(agents, seconds, Path(workdir), **kwargs))
    with tempfile.TemporaryDirectory(prefix="harness-soak-") as tmp:
        return run_loop(soak(agents, seconds, Path(tmp), **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# The checks and the figures.
# ---------------------------------------------------------------------------------------------------------------


def problems(r: dict, rss_bound_mb: float = RSS_BOUND_MB,
             outside_duckdb_bound_mb: float = OUTSIDE_DUCKDB_BOUND_MB) -> list[str]:
    """Everything wrong with a soak run; [] when it passed."""
    out = []
    if r["calls_answered"] == 0:
        out.append("no call was answered")
    if r["agent_errors"] or r["hung_agents"]:
        out.append(f"{r['agent_errors']} calls failed and {r['hung_agents']} agents hung at the deadline: "
                   f"{r['agent_error_examples'][:3]}")
    counts = {k: r[k] for k in ("calls_answered", "calls_recorded_ok", "calls_recorded", "engine_served",
                                "engine_received")}
    if len(set(counts.values())) != 1:
        out.append(f"calls do not add up: {counts}")
    if r["recorded_errors"]:
        out.append(f"calls recorded as not ok: {r['recorded_errors'][:3]}")
    if r["recorded_streamed"] != r["streamed"]:
        out.append(f"{r['recorded_streamed']} streamed calls recorded, agents streamed {r['streamed']}")
    per = r["_per_episode"]
    bad = []
    for episode in sorted(set(per["answered"]) | set(per["served"]) | set(per["recorded"])):
        n_answered, n_served = per["answered"].get(episode, 0), per["served"].get(episode, 0)
        n, lo, hi, distinct = per["recorded"].get(episode, (0, None, None, 0))
        if not (n_answered == n_served == n == per["recorded_ok"].get(episode, 0)) or (
                n and (lo, hi, distinct) != (0, n - 1, n)):
            bad.append(f"{episode}: answered {n_answered}, served {n_served}, recorded {n} "
                       f"(call_index {lo}..{hi}, {distinct} distinct)")
    if bad:
        out.append(f"{len(bad)} episodes do not add up, e.g. {bad[:5]}")
    if r["episode_rows"] != r["episodes"]:
        out.append(f"{r['episode_rows']} episode rows recorded for {r['episodes']} episodes")
    if r["proxy_died_with"] is not None:
        out.append(f"harness serve died during the soak (exit {r['proxy_died_with']})")
    if r["proxy_exit_code"] != 0:
        out.append(f"harness serve exited with {r['proxy_exit_code']} on SIGINT")
    if r["runs_ended"] != [1, 1]:
        out.append(f"the run was not closed cleanly (runs ended/total: {r['runs_ended']})")
    if r["spill_file"]:
        out.append("the recorder spilled records (a .spill.jsonl next to the database)")
    if r["proxy_log_problems"]:
        out.append(f"the proxy logged problems: {r['proxy_log_problems'][:5]}")
    grew = (f"proxy RSS grew {r['rss_growth_mb']} MB after the warm-up ({r['rss_warmup_end_mb']} MB at "
            f"{r['rss_warmup_end_at_s']} s -> {r['rss_end_mb']} MB at {r['rss_end_at_s']} s; DuckDB's buffer "
            f"memory {r['duckdb_mb']})")
    if not r["rss_samples_mb"] or r["rss_growth_mb"] >= rss_bound_mb:
        out.append(f"{grew}: bound {rss_bound_mb} MB")
    duck_end = sum(r["duckdb_mb"].get("end", {}).values())
    if duck_end > DB_MEMORY_MB:
        out.append(f"DuckDB holds {duck_end} MB at the end, above its cap of {DB_MEMORY_MB} MB")
    if r["rss_growth_outside_duckdb_mb"] >= outside_duckdb_bound_mb:
        out.append(f"{grew}, {r['rss_growth_outside_duckdb_mb']} MB of it outside DuckDB's buffer memory: bound "
                   f"{outside_duckdb_bound_mb} MB")
    return out


def figures(r: dict) -> dict:
    """What a soak run reports: the result without the per-episode detail."""
    return {k: v for k, v in r.items() if not k.startswith("_")}


def summary(r: dict) -> str:
    lat = r["latency_ms"]
    samples = " ".join(f"{mb:.0f}" for _, mb in r["rss_samples_mb"])
    return "\n".join([
        f"soak: {r['agents']} agents, {r['seconds']:.0f} s (drained at {r['elapsed_s']} s), "
        f"{r['episodes']} episodes",
        f"  calls: answered {r['calls_answered']} ({r['streamed']} streamed), recorded ok {r['calls_recorded_ok']} "
        f"of {r['calls_recorded']}, engine served {r['engine_served']} {r['engine_served_by_route']}",
        f"  {r['calls_per_s']} calls/s (by quarter: {r['calls_per_s_by_quarter']}), "
        f"latency p50 {lat['p50']} ms, p99 {lat['p99']} ms, max {lat['max']} ms; "
        f"proxy CPU {r['proxy_cpu_share']} cores",
        f"  continuity: {r['continuity']}",
        f"  proxy RSS: {r['rss_warmup_end_mb']} MB at warm-up end ({r['rss_warmup_end_at_s']} s), "
        f"{r['rss_end_mb']} MB at the end ({r['rss_end_at_s']} s): growth {r['rss_growth_mb']} MB "
        f"({r['rss_growth_kb_per_call']} KB per call after the warm-up), "
        f"peak {r['rss_peak_mb']} MB; recorder backlog when the agents were done: "
        f"{r['pending_records_at_drain']} records",
        f"  of which DuckDB's buffer memory (by its own count): {r['duckdb_growth_mb']} MB, outside it "
        f"{r['rss_growth_outside_duckdb_mb']} MB; "
        f"warm-up end {r['duckdb_mb'].get('warmup_end')}, end {r['duckdb_mb'].get('end')}",
        f"  RSS samples (MB, 1/s): {samples}",
        f"  harness serve: exit {r['proxy_exit_code']} after SIGINT in {r['proxy_stop_s']} s; "
        f"errors: agents {r['agent_errors']}, recorded {len(r['recorded_errors'])}",
    ])


def write_report(r: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(figures(r), indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--think", type=float, default=0.1, help="longest think time between turns, seconds")
    ap.add_argument("--rss-bound-mb", type=float, default=RSS_BOUND_MB,
                    help="allowed RSS growth after the warm-up (default: %(default)s)")
    ap.add_argument("--outside-duckdb-bound-mb", type=float, default=OUTSIDE_DUCKDB_BOUND_MB,
                    help="allowed RSS growth after the warm-up outside DuckDB's buffer memory (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, help="keep the database here (default: a temporary directory)")
    ap.add_argument("--report", default=os.environ.get("HARNESS_SOAK_REPORT"),
                    help="write the figures as JSON here (default: env HARNESS_SOAK_REPORT)")
    args = ap.parse_args(argv)
    r = run_soak(args.agents, args.seconds, args.workdir, seed=args.seed, think_s=args.think, progress=True)
    print(summary(r))
    if args.report:
        write_report(r, args.report)
    wrong = problems(r, args.rss_bound_mb, args.outside_duckdb_bound_mb)
    for p in wrong:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
