"""What cut or flagged a call: truncations (never silent) and the degenerate-output guard's findings.

Every finding is a flag in the call's `extra.flags`, and so a row of the `flags` view (docs/schema.md):

    {"choice": 0, "kind": "truncated", "reason": "max_tokens", "value": 64, "threshold": 64}

- kind "truncated": a completion cut by the request's max_tokens (reason `max_tokens`) or by the engine's context
  (`max_model_len`: cut short of max_tokens, or refused because the prompt filled the context); a call refused
  because its episode had ended (`max_turns`: the episode made its `max_turns` calls; `guard`: the guard ended it).
  Flags without a choice concern the whole episode: every sample of it lists the reason (samples.truncation).
- kind "degenerate": the guard's cheap checks of a completion, each documented with its threshold:
  `repetition` (the share of its n-grams that repeat an earlier one), `low_surprisal` (mean -logprob per sampled
  token: a model stuck in a loop is sure of every token; an entropy collapse seen through the sampled tokens) and,
  when asked, `length_cap` (it ran into max_tokens). Completions shorter than `min_tokens` are never degenerate.

The guard only looks when enabled. With `end_episode`, an episode with a degenerate completion ends there: the
proxy answers its later calls with a 400 (`episode_ended`), so the agent stops (it has the reply already).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.records import Call

TRUNCATED, DEGENERATE = "truncated", "degenerate"
_CONTEXT_FULL = "maximum context length"  # vLLM's 400 for a prompt (plus max_tokens) past max_model_len


@dataclass(frozen=True)
class GuardConfig:
    """The degenerate-output guard (off by default)."""

    enabled: bool = False
    ngram: int = 4  # repetition is counted over n-grams of this many tokens
    max_repeat: float = 0.5  # a completion whose share of repeated n-grams exceeds this is degenerate
    min_tokens: int = 32  # shorter completions are never judged degenerate
    min_surprisal: float | None = None  # mean -logprob (nats) per sampled token below this is degenerate; None: off
    length_cap: bool = False  # a completion cut by max_tokens counts as degenerate too
    end_episode: bool = False  # a degenerate completion ends its episode: later calls are refused

    def __post_init__(self):
        if self.ngram < 1:
            raise ValueError(f"guard ngram {self.ngram!r} must be a positive number of tokens")
        if not 0 <= self.max_repeat <= 1:
            raise ValueError(f"guard max_repeat {self.max_repeat!r} is a share: use a value in [0, 1]")
        if self.min_tokens < 1:
            raise ValueError(f"guard min_tokens {self.min_tokens!r} must be a positive number of tokens")
        if self.min_surprisal is not None and self.min_surprisal < 0:
            raise ValueError(f"guard min_surprisal {self.min_surprisal!r} is in nats per token: use a value >= 0")


def repeat_share(units: Sequence, n: int) -> float:
    """The share of the n-grams of `units` that already occurred earlier in it: 0.0 for a completion that never
    repeats itself, close to 1.0 for a loop ("a b a b a b ..." with n = 2: every n-gram after the first two)."""
    grams = [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def mean_surprisal(logprobs: Sequence[float]) -> float:
    """Mean -logprob of the sampled tokens: its expectation is the sampling distribution's entropy."""
    return -sum(logprobs) / len(logprobs) if logprobs else 0.0


def flags_of(call: Call, max_tokens: int | None, guard: GuardConfig) -> list[dict]:
    """The flags of a recorded call: each choice's truncation, the guard's findings, a context-full refusal."""
    flags = []
    if call.http_status == 400 and _CONTEXT_FULL in (call.error or ""):
        flags.append(_flag(None, TRUNCATED, "max_model_len"))
    for ch in call.choices:
        n = len(ch.completion_ids) if ch.completion_ids is not None else None
        cut = ch.finish_reason == "length"
        by_max_tokens = cut and max_tokens is not None and (n is None or n >= max_tokens)
        if cut:
            flags.append(_flag(ch.index, TRUNCATED, "max_tokens" if by_max_tokens else "max_model_len", n, max_tokens))
        if not guard.enabled:
            continue
        if by_max_tokens and guard.length_cap:
            flags.append(_flag(ch.index, DEGENERATE, "length_cap", n, max_tokens))
        units = ch.completion_ids if ch.completion_ids is not None else (ch.text or "").split()
        if len(units) < guard.min_tokens:
            continue
        share = repeat_share(units, guard.ngram)
        if share > guard.max_repeat:
            flags.append(_flag(ch.index, DEGENERATE, "repetition", round(share, 4), guard.max_repeat))
        if guard.min_surprisal is not None and ch.logprobs:
            surprisal = mean_surprisal(ch.logprobs)
            if surprisal < guard.min_surprisal:
                flags.append(_flag(ch.index, DEGENERATE, "low_surprisal", round(surprisal, 4), guard.min_surprisal))
    return flags


def max_tokens_of(body: dict) -> int | None:
    """The completion cap a chat or completions request sets (None: the engine's, up to the context's end)."""
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) else None


def ended_flag(reason: str, value: float | None = None, threshold: float | None = None) -> dict:
    """The flag of a call refused because its episode ended (reason `max_turns` or `guard`)."""
    return _flag(None, TRUNCATED, reason, value, threshold)


def degenerate(flags: Sequence[dict]) -> str | None:
    """The first degenerate finding's reason, if any."""
    return next((f["reason"] for f in flags if f["kind"] == DEGENERATE), None)


def _flag(choice: int | None, kind: str, reason: str, value: float | None = None,
          threshold: float | None = None) -> dict:
    return {"choice": choice, "kind": kind, "reason": reason, "value": value, "threshold": threshold}
