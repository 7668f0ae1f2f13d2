"""A call's flags: what cut it short, and what the proxy's degenerate-output guard found (proxy/guard.py).

Flags live in `calls.extra.flags`, one object per finding, and are read through the `flags` view (docs/schema.md):

    {"choice": 0, "kind": "truncated", "reason": "max_tokens", "value": 64, "threshold": 64}

A flag without a choice concerns the whole episode (a refused call, a prompt past the context): every sample of
the episode lists its reason in `samples.truncation`.
"""

from __future__ import annotations

from harness.core.records import Call

TRUNCATED, DEGENERATE, PARSE = "truncated", "degenerate", "parse"
_CONTEXT_FULL = "maximum context length"  # vLLM's 400 for a prompt (plus max_tokens) past max_model_len


def flag(choice: int | None, kind: str, reason: str, value: float | None = None,
         threshold: float | None = None) -> dict:
    return {"choice": choice, "kind": kind, "reason": reason, "value": value, "threshold": threshold}


def max_tokens_of(body: dict) -> int | None:
    """The completion cap a chat or completions request sets (None: the engine's, up to the context's end)."""
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) else None


def truncations(call: Call, max_tokens: int | None) -> list[dict]:
    """What cut the call short: each choice the engine stopped at max_tokens (`max_tokens`) or at the context's end
    (`max_model_len`: short of max_tokens, or with none asked), and a prompt the engine refused as too long."""
    out = []
    if call.http_status == 400 and _CONTEXT_FULL in (call.error or ""):
        out.append(flag(None, TRUNCATED, "max_model_len"))
    for ch in call.choices:
        if ch.finish_reason != "length":
            continue
        n = len(ch.completion_ids) if ch.completion_ids is not None else None
        by_max_tokens = max_tokens is not None and (n is None or n >= max_tokens)
        out.append(flag(ch.index, TRUNCATED, "max_tokens" if by_max_tokens else "max_model_len", n, max_tokens))
    return out


def cuts(call: Call) -> list[dict]:
    """The call's truncation flags: as the proxy recorded them; for a call recorded before the proxy flagged calls
    (no `flags` note), each reply that ran out is flagged `length` (whether max_tokens or the context cut it was
    not recorded) and a context-full refusal `max_model_len`."""
    if "flags" in call.extra:
        return [f for f in call.extra["flags"] if f.get("kind") == TRUNCATED]
    return [f if f["choice"] is None else {**f, "reason": "length"} for f in truncations(call, None)]
