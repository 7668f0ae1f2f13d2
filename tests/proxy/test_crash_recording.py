"""A proxy killed under load loses no call it answered (harness/store/journal.py).

`harness serve` (its own process, the scripted engine upstream) is sent SIGKILL while 16 agents call it, half of the
calls streamed; three rounds on one database, killed at different moments (0.3, 0.7 and 1.2 s after the round's first
answers): each round's proxy opens the file left by the last one's kill, and the last round's is read by `harness
sql`'s path (a read-only open of a closed file). Every call an agent saw answered whole (a 200 with its JSON body, or
a stream through `[DONE]`), named by the `x-harness-call-id` header, is then recorded `ok` under that id, with its
episode. Recorded beyond that: at most one call per agent per round, the one whose answer the kill cut off after it
was journaled.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson

from bench.soak_parts import ProxyProcess
from harness.store.journal import pending_records
from harness.store.sql import run_sql
from proxy.forward import CALL_ID_HEADER

AGENTS = 16
KILL_AFTER_S = (0.3, 0.7, 1.2)  # after the round's first 16 answers


async def _agent(session: aiohttp.ClientSession, url: str, episode: str, answered: list[str]) -> None:
    """Calls until the proxy is gone; appends the call id of every answer it got whole."""
    for turn in range(10**6):
        stream = turn % 2 == 1
        body = {"model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}], "stream": stream}
        try:
            async with session.post(f"{url}/e/{episode}/v1/chat/completions", json=body) as resp:
                call_id, status = resp.headers.get(CALL_ID_HEADER), resp.status
                data = await resp.read()
            whole = data.rstrip().endswith(b"data: [DONE]") if stream else bool(orjson.loads(data)["choices"])
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
            return  # the proxy is gone
        assert status == 200 and call_id, (status, data[:200])
        if whole:
            answered.append(call_id)


async def test_a_proxy_killed_under_load_loses_no_answered_call(upstream, tmp_path):
    db = tmp_path / "harness.duckdb"
    answered: dict[str, str] = {}  # call id -> episode
    per_round, journaled = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        for k, kill_after in enumerate(KILL_AFTER_S):
            proxy = await ProxyProcess.start(upstream.url, db, tmp_path)  # opens the file: replays the last journal
            got: dict[str, list[str]] = {f"r{k}-agent{j}": [] for j in range(AGENTS)}
            agents = [asyncio.create_task(_agent(session, proxy.url, episode, ids)) for episode, ids in got.items()]
            try:
                for _ in range(600):  # the first answers: the proxy is warm (a loaded machine may take seconds)
                    if sum(map(len, got.values())) >= AGENTS:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(kill_after)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    proxy.proc.kill()
                await proxy.proc.wait()
            await asyncio.gather(*agents)
            per_round.append(sum(map(len, got.values())))
            journaled.append(pending_records(db))  # what the kill left unwritten
            answered.update((call_id, episode) for episode, ids in got.items() for call_id in ids)

    result = run_sql(db, "SELECT call_id, episode_id, status FROM calls WHERE episode_id LIKE 'r%-agent%'")
    recorded = {call_id: (episode, status) for call_id, episode, status in result.rows}
    episodes = {row[0] for row in run_sql(db, "SELECT episode_id FROM episodes").rows}
    report = f"answered per round {per_round}, journal records left by each kill {journaled}, recorded {len(recorded)}"
    print("\n" + report)

    assert all(n > 0 for n in per_round), report
    assert sum(journaled) > 0, report  # the kills caught answered calls not yet written: the journal had work to do
    missing = sorted(set(answered) - set(recorded))
    assert missing == [], f"{len(missing)} answered calls not recorded: {missing[:5]}; {report}"
    assert all(recorded[c] == (episode, "ok") for c, episode in answered.items()), report
    assert set(answered.values()) <= episodes, report
    extra = len(recorded) - len(answered)  # journaled, then the kill cut the answer off
    assert 0 <= extra <= AGENTS * len(KILL_AFTER_S), report
    assert pending_records(db) == 0, report  # the read-only open wrote the journal in and cleared it
