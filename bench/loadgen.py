"""The load generator: keep-alive HTTP/1.1 on asyncio.Protocol, Content-Length or chunked answers, SSE event times.

The client side of bench/proxy_overhead.py, run in its own process pinned to the engine's core.
"""

from __future__ import annotations

import asyncio
import time

import orjson

try:
    import uvloop
except ImportError:  # uvloop is optional: the asyncio loop then drives the load
    uvloop = None


def run_loop(coro, loop_kind: str = "uvloop"):
    """Run `coro` on a fresh loop of the given kind (uvloop when installed and asked for)."""
    factory = uvloop.new_event_loop if loop_kind == "uvloop" and uvloop else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


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


def client_blocks(targets: dict[str, bytes], n: int, block: int, warmup: int, settle_s: float, stream: bool) -> dict:
    """c=1: `block` requests to one path, a pause, the next path; the path order rotates every round."""

    async def main():
        conns = {name: await Http.open(raw) for name, raw in targets.items()}
        out = {name: {"latency": [], "ttft": [], "errors": 0, "sent": 0} for name in targets}

        async def one(name: str, keep: bool) -> None:
            t0 = time.perf_counter()
            status, _, events = await conns[name].call(targets[name], stream)
            t1 = time.perf_counter()
            r = out[name]
            r["sent"] += 1
            r["errors"] += status != 200
            if keep:
                r["latency"].append(t1 - t0)
                if stream:
                    r["ttft"].append(content_times(events)[0] - t0)

        for name in targets:
            for _ in range(warmup):
                await one(name, False)
        await asyncio.sleep(settle_s)
        names = list(targets)
        for i in range(-(-n // block)):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                for _ in range(min(block, n - i * block)):
                    await one(name, True)
                await asyncio.sleep(settle_s)
        for conn in conns.values():
            conn.transport.close()
        return out

    return run_loop(main())


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

    return run_loop(main())


def client_streams(raw: bytes, concurrency: int, per_client: int, stagger_s: float) -> dict:
    """`concurrency` clients each reading streams in a row; gaps between content chunks, time to the first."""

    async def main():
        out = {"gaps": [], "ttft": [], "errors": 0, "sent": 0}

        async def worker(i: int):
            conn = await Http.open(raw)
            await asyncio.sleep(i * stagger_s)  # starts spread over one chunk interval, not in lockstep
            for k in range(1 + per_client):  # the first stream warms the connections (ours and the proxy's)
                t0 = time.perf_counter()
                status, _, events = await conn.call(raw, stream=True)
                out["sent"] += 1
                out["errors"] += status != 200
                if k == 0:
                    continue
                times = content_times(events)
                out["ttft"].append(times[0] - t0)
                out["gaps"].extend(b - a for a, b in zip(times, times[1:], strict=False))
            conn.transport.close()

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return out

    return run_loop(main())


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)
