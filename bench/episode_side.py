"""Side measurements of bench/episode_overhead.py: what starting judge workers costs, and how the runner's store
steps grow with a bigger episode (10 tool turns) in a growing store.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A program that starts a judge pool and times its first judgement; HEAVY is put at its top or left out.
POOL_START = textwrap.dedent('''
    import asyncio, json, sys, time
    sys.path.insert(0, {root!r})
    {heavy}
    from harness.running.judge_pool import JudgePool

    async def main():
        import psutil
        t0 = time.perf_counter()
        pool = JudgePool("exact_match", workers=2)
        t1 = time.perf_counter()
        await asyncio.gather(*(pool.judge("e", {{"answer": "1"}}, "1", []) for _ in range(2)))
        t2 = time.perf_counter()
        cpu = [sum(psutil.Process(p).cpu_times()[:2]) for p in pool.worker_pids]
        pool.close()
        print(json.dumps({{"ctor_ms": (t1 - t0) * 1000, "first_ms": (t2 - t1) * 1000, "worker_cpu_s": cpu}}))

    if __name__ == "__main__":
        asyncio.run(main())
''')
HEAVY_MAIN = "import harness.running.dataset  # noqa: F401  (what a script that calls run_dataset imports)"


def judge_worker_start(tmp: Path) -> dict[str, dict]:
    """A fresh program starting a 2-worker judge pool, with a light and with a heavy __main__."""
    out = {}
    for name, heavy in (("light", ""), ("heavy", HEAVY_MAIN)):
        script = tmp / f"pool_{name}.py"
        script.write_text(POOL_START.format(root=str(ROOT), heavy=heavy))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                              cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(f"judge pool start ({name}) failed: {done.stderr[-500:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _conversation_calls(turns: int, episode_id: str) -> list:
    """An agent's episode of `turns` calls; each request carries the whole conversation so far (~2 kB a turn)."""
    import random
    import uuid

    import orjson

    from harness.core.records import ENGINE, OK, Call, Choice

    rng = random.Random(episode_id)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(2000)]
    messages = [{"role": "system", "content": "You are an agent."}]
    calls = []
    for turn in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choices(words, k=330))})
        answer = " ".join(rng.choices(words, k=160))
        response = {"id": f"c{turn}", "object": "chat.completion", "model": "policy",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                 "finish_reason": "stop"}], "usage": {"prompt_tokens": 500 * (turn + 1),
                                                                      "completion_tokens": 200}}
        calls.append(Call(
            call_id=uuid.uuid4().hex, run_id="side", episode_id=episode_id, call_index=turn, endpoint="chat",
            stream=False, requested_model="gpt-4o-mini", served_model="policy", role_key="r0", system_hash="s0",
            tools_hash=None, request=orjson.dumps({"model": "gpt-4o-mini", "messages": messages}),
            response=orjson.dumps(response), prompt_ids=list(range(500 * (turn + 1))),
            choices=[Choice(0, list(range(200)), [-0.5] * 200, "stop", answer)], token_source=ENGINE, status=OK,
            http_status=200, error=None, started_at=time.time(), latency_ms=100.0, ttft_ms=None, weight_version=0,
            prompt_tokens=500 * (turn + 1), completion_tokens=200))  # fmt: skip
        messages.append({"role": "assistant", "content": answer})
    return calls


async def bigger_episode(tmp: Path, turns: int = 10, episodes: int = 50, blocks: int = 8) -> dict:
    """episode_calls and a judge round trip for episodes of `turns` calls, in a store holding one block of
    `episodes` such episodes, then `blocks` of them (written a block at a time, as the recorder batches)."""
    import dataclasses
    import pickle

    from harness.running.judge_pool import JudgePool
    from harness.store.database import Store

    base = [_conversation_calls(turns, f"side-{e}") for e in range(episodes)]
    json_kb = sum(len(c.request) + len(c.response) for c in base[0]) / 1024
    out = {"turns": turns, "json_kb": json_kb, "episode_calls_ms": {}}
    store = Store.open(tmp / "side.duckdb")
    try:
        async with JudgePool("exact_match", workers=1) as pool:
            for block in range(blocks):
                store.add_calls([dataclasses.replace(c, call_id=f"{block}-{c.call_id}",
                                                     episode_id=f"b{block}-{c.episode_id}")
                                 for calls in base for c in calls])
                if block not in (0, blocks - 1):
                    continue
                read, judge = [], []
                for e in range(0, episodes, 5):
                    t0 = time.perf_counter()
                    calls = store.episode_calls(f"b{block}-side-{e}")
                    t1 = time.perf_counter()
                    await pool.judge(f"b{block}-side-{e}", {"answer": "1"}, "1", calls)
                    read.append((t1 - t0) * 1000)
                    judge.append((time.perf_counter() - t1) * 1000)
                out["episode_calls_ms"][(block + 1) * episodes * turns] = statistics.median(read)
                out["judge_ms"] = statistics.median(judge)
        out["job_kb"] = len(pickle.dumps(({"answer": "1"}, "1", calls), protocol=pickle.HIGHEST_PROTOCOL)) / 1024
    finally:
        store.close()
    return out
