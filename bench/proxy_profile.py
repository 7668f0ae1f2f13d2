"""Profile the recording proxy under c=64 load with py-spy (sampling; all threads of the proxy process).

Same pinning as bench/proxy_overhead.py: the proxy (bench.hops.proxy_main: serve_forever on asyncio, as
`harness serve` runs it; journal on, batches 256 / 0.2 s) alone on core 0; the scripted engine (uvloop), the load
generator and py-spy itself on core 1.

Workloads (one proxy process each, fresh DuckDB file):
  nonstream  the bench's request (system + ~2 kB user turn, default episode), 512 prompt ids + 32 tokens back
  stream     the same with "stream": true (32 chunks arriving at once)
  multiturn  episodes of --turns calls each at /e/<ep>/v1: every call re-sends the history (each earlier reply
             echoed back with its whitespace stripped, then a ~300-char tool result); the engine answers /tokenize
             with a toy append-only template, so later calls go token-exact (find + splice + completions + ChatAnswer)

    pip install py-spy   # a profiler, not a dependency of the project
    python -m bench.proxy_profile [--workloads nonstream,stream,multiturn] [--seconds 15] [--rate 250] [--gil]
        [--out runs/proxy-profile]
    python -m bench.profile_stacks runs/proxy-profile/nonstream.txt --top 25   # own and cumulative time per function

py-spy without --gil counts a thread that waits for the core as busy (the line after each system call looks
expensive): use --gil for Python time, and `perf` (--perf) for GC, the kernel and DuckDB.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import orjson
from aiohttp import web

from bench.hops import ENGINES, LOAD_CORE, PROXY_CORE, Child, pin, proxy_main, watch_parent
from bench.loadgen import Http, client_load, run_loop
from bench.proxy_overhead import requests_for
from proxy.scripted_engine import ScriptedEngine

PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def _word_id(word: str) -> int:
    return 5000 + zlib.crc32(word.encode()) % 100000


def render(messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """A toy append-only chat template: <s> role words </s> \\n per message; the turn end is [2, 3]."""
    roles = {"system": 10, "user": 11, "assistant": 12, "tool": 13}
    out = []
    for m in messages:
        content = m.get("content") or ""
        if not isinstance(content, str):
            content = orjson.dumps(content).decode()
        out += [1, roles.get(m.get("role"), 14), *(_word_id(w) for w in content.split()), 2, 3]
    if add_generation_prompt:
        out += [1, 12]
    return out


class TokenizingEngine(ScriptedEngine):
    def __init__(self, script):
        super().__init__(script)
        self.app.router.add_post("/tokenize", self._tokenize)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        tokens = render(body["messages"], body.get("add_generation_prompt", True))
        return web.Response(body=orjson.dumps({"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20}),
                            content_type="application/json")


def engine_main(conn, core: int) -> None:
    pin(core)

    async def main():
        engine = TokenizingEngine(ENGINES["fast"])
        conn.send({"fast": await engine.start()})
        stop = asyncio.Event()
        import signal

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        watch_parent(conn)
        while not stop.is_set():
            engine.requests.clear(), engine.headers.clear(), engine.authorizations.clear(), engine.targets.clear()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        await engine.stop()

    run_loop(main(), "uvloop")


def multiturn_load(url: str, concurrency: int, turns: int, warmup_s: float, window_s: float) -> dict:
    """`concurrency` agents, each running episodes of `turns` calls in a row; counts calls in the window."""
    host = url.split("//", 1)[1]
    tool_result = " ".join(f"line{i % 37}: value {i * 7 % 101}" for i in range(40))  # ~300 chars

    def raw(episode: str, messages: list[dict]) -> bytes:
        body = orjson.dumps({"model": "gpt-4o-mini", "messages": messages, "max_tokens": 32, "temperature": 1.0})
        head = (f"POST /e/{episode}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sk-bench"
                f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

    async def main():
        t_measure = time.perf_counter() + warmup_s
        t_end = t_measure + window_s
        out = {"in_window": 0, "errors": 0, "sent": 0, "modes": {}}
        conns = [await Http.open(raw("x", [])) for _ in range(concurrency)]

        async def agent(k: int, conn: Http):
            n = 0
            while time.perf_counter() < t_end:
                episode = f"ep-{k}-{n}"
                n += 1
                messages = [{"role": "system", "content": "You are a careful agent."},
                            {"role": "user", "content": "Fix the failing test. " + tool_result}]
                for turn in range(turns):
                    if time.perf_counter() >= t_end:
                        break
                    status, body, _ = await conn.call(raw(episode, messages))
                    t1 = time.perf_counter()
                    out["sent"] += 1
                    out["errors"] += status != 200
                    if t_measure <= t1 < t_end:
                        out["in_window"] += 1
                    reply = orjson.loads(body)["choices"][0]["message"]
                    messages.append({"role": "assistant", "content": (reply.get("content") or "").strip()})
                    messages.append({"role": "user", "content": f"Result {turn}: {tool_result}"})

        await asyncio.gather(*(agent(k, c) for k, c in enumerate(conns)))
        out["calls_per_s"] = out["in_window"] / window_s
        return out

    return run_loop(main())


def modes(db: Path) -> dict:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("SELECT coalesce(json_extract_string(extra, '$.continuity.mode'), '-') || ':' || "
                           "coalesce(json_extract_string(extra, '$.continuity.reason'), '-') AS m, count(*) "
                           "FROM calls GROUP BY m ORDER BY 2 DESC").fetchall()
        return dict(rows)
    finally:
        con.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="nonstream,stream,multiturn")
    ap.add_argument("--seconds", type=float, default=15.0, help="py-spy sampling window per workload")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--out", default="runs/proxy-profile")
    ap.add_argument("--no-spy", action="store_true", help="measure calls/s only")
    ap.add_argument("--nonblocking", action="store_true", help="py-spy reads without pausing the proxy")
    ap.add_argument("--gil", action="store_true", help="py-spy samples only the thread holding the GIL")
    ap.add_argument("--perf", action="store_true", help="perf record (native stacks, all threads) instead of py-spy")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a ProxyConfig field for the proxy, e.g. --set record_batch=2048 (a JSON value)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = {}
    for setting in args.set:
        field, sep, value = setting.partition("=")
        if not sep:
            ap.error(f"--set {setting!r}: expected FIELD=VALUE, e.g. record_batch=2048")
        overrides[field] = orjson.loads(value)
    pin(LOAD_CORE)
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(1, initializer=pin, initargs=(LOAD_CORE,))
    engine = Child(engine_main, LOAD_CORE).ready()
    url = engine.served["fast"]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.workloads.split(","):
                db = Path(tmp) / f"{name}.duckdb"
                proxy = Child(proxy_main, PROXY_CORE, url, str(db), "asyncio", overrides, None).ready()
                total = args.warmup + args.seconds + 1.0
                if name == "multiturn":
                    pending = pool.apply_async(multiturn_load, (proxy.served, args.concurrency, args.turns,
                                                                args.warmup, args.seconds))
                else:
                    raw = requests_for(url, name == "stream", proxy=proxy.served)["proxy"]
                    pending = pool.apply_async(client_load, (raw, args.concurrency, args.warmup, args.seconds))
                time.sleep(args.warmup)
                c0, g0 = proxy.cpu(), proxy.gc_seconds()
                spy = None
                if args.perf:
                    spy = subprocess.Popen(
                        ["taskset", "-c", str(LOAD_CORE), "perf", "record", "-F", "999", "-g", "-p",
                         str(proxy.process.pid), "-o", str(out / f"{name}.perf.data"), "--", "sleep",
                         str(args.seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                elif not args.no_spy:
                    spy = subprocess.Popen(
                        ["taskset", "-c", str(LOAD_CORE), PY_SPY, "record", "--pid", str(proxy.process.pid),
                         "--rate", str(args.rate), "--duration", str(int(args.seconds)), "--format", "raw",
                         "--threads", "--full-filenames", "--output", str(out / f"{name}.txt"),
                         *(["--nonblocking"] if args.nonblocking else []), *(["--gil"] if args.gil else [])],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(args.seconds)
                c1, g1 = proxy.cpu(), proxy.gc_seconds()
                res = pending.get(timeout=total + 60)
                if spy is not None:
                    _, err = spy.communicate(timeout=60)
                    if spy.returncode:
                        print(err.decode()[-2000:], file=sys.stderr)
                proxy.stop()
                cpu_loop, cpu_other = (c1[0] - c0[0]) / args.seconds, (c1[1] - c0[1]) / args.seconds
                rate = res["calls_per_s"]
                summary = {"workload": name, "calls_per_s": round(rate), "errors": res["errors"],
                           "loop_cpu": round(cpu_loop, 3), "other_cpu": round(cpu_other, 3),
                           "us_per_call_loop": round(cpu_loop / rate * 1e6) if rate else None,
                           "us_per_call_other": round(cpu_other / rate * 1e6) if rate else None,
                           "gc_share_of_proxy_cpu": round((g1 - g0) / args.seconds / (cpu_loop + cpu_other), 3)}
                if name == "multiturn":
                    summary["modes"] = modes(db)
                print(orjson.dumps(summary).decode(), flush=True)
                (out / f"{name}.json").write_bytes(orjson.dumps(summary))
    finally:
        pool.terminate()
        pool.join()
        engine.stop()


if __name__ == "__main__":
    main()
