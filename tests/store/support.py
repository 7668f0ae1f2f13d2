"""What the store's tests share: a realistic recorded call and small waits (the `store` fixture is in conftest.py)."""

from __future__ import annotations

import random
import time
import uuid

import orjson

from harness.core.records import ENGINE, OK, Call, Choice
from harness.store.database import Store

_rng = random.Random(1234)


def make_call(
    episode_id: str = "ep-0",
    call_index: int = 0,
    *,
    call_id: str | None = None,
    n_choices: int = 2,
    prompt_tokens: int = 2000,
    status: str = OK,
) -> Call:
    """A realistic call: a 2k-token prompt, ~200-token completions with logprobs, JSON request, response."""
    prompt_ids = [_rng.randrange(151_000) for _ in range(prompt_tokens)]
    choices = [
        Choice(
            index=i,
            completion_ids=[_rng.randrange(151_000) for _ in range(200 + i)],
            logprobs=[-_rng.expovariate(2.0) for _ in range(200 + i)],
            finish_reason="tool_calls" if i else "stop",
            text=f"answer {i} ✓",
            tool_calls=[{"id": "t1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
            if i
            else None,
            reasoning="thinking…" if i else None,
        )
        for i in range(n_choices)
    ]
    messages = [{"role": "user", "content": "word " * 1500}]
    request = {"model": "gpt-4o-mini", "messages": messages, "n": n_choices}
    return Call(
        call_id=call_id or uuid.uuid4().hex,
        run_id="run-1",
        episode_id=episode_id,
        call_index=call_index,
        endpoint="chat",
        stream=True,
        requested_model="gpt-4o-mini",
        served_model="policy",
        role_key="role-a",
        system_hash=None,
        tools_hash="tools-1",
        request=orjson.dumps(request),
        response=orjson.dumps({"id": "chatcmpl-1", "choices": [{"index": 0}]}) if status == OK else None,
        prompt_ids=prompt_ids,
        choices=choices if status == OK else [],
        token_source=ENGINE,
        status=status,
        http_status=200 if status == OK else 502,
        error=None if status == OK else "upstream went away",
        started_at=1_763_812_345.123456 + call_index,
        latency_ms=812.5,
        ttft_ms=35.25,
        weight_version=7,
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(len(c.completion_ids) for c in choices) if status == OK else None,
        extra={"temperature_override": 1.0},
    )


def count(store: Store, table: str) -> int:
    return store.query(f"SELECT count(*) FROM {table}").rows[0][0]


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
