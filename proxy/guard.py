"""The degenerate-output guard: cheap checks of every completion the proxy records, and its flags.

A call's flags (harness/core/flags.py) say what cut it short, always, and what the guard found, when it is enabled:
kind "degenerate", one per finding, each measured against a documented threshold:
- `repetition`: the share of the completion's n-grams that repeat an earlier one;
- `low_surprisal`: the mean -logprob per sampled token (a model stuck in a loop is sure of every token: an entropy
  collapse seen through the sampled tokens);
- `length_cap`, when asked: it ran into max_tokens.
Completions shorter than `min_tokens` are never judged by the first two. With `end_episode`, an episode with a
degenerate completion ends there: the proxy answers its later calls with a 400 (`episode_ended`), so the agent
stops (it has the reply already); the refused calls are flagged `truncated` / `guard`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.core.flags import DEGENERATE, TRUNCATED, flag, truncations
from harness.core.records import Call


@dataclass(frozen=True)
class GuardConfig:
    """The degenerate-output guard (off by default)."""

    enabled: bool = False
    ngram: int = 4  # repetition is counted over n-grams of this many tokens
    max_repeat: float = 0.5  # a completion whose share of repeated n-grams exceeds this is degenerate
    min_tokens: int = 32  # shorter completions are never judged by repetition or surprisal
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
    """The flags of a recorded call: what cut it short (harness/core/flags.py) and, with the guard on, its findings."""
    flags = truncations(call, max_tokens)
    if not guard.enabled:
        return flags
    for ch in call.choices:
        n = len(ch.completion_ids) if ch.completion_ids is not None else None
        if guard.length_cap and any(f["choice"] == ch.index and f["reason"] == "max_tokens" for f in flags):
            flags.append(flag(ch.index, DEGENERATE, "length_cap", n, max_tokens))
        units = ch.completion_ids if ch.completion_ids is not None else (ch.text or "").split()
        if len(units) < guard.min_tokens:
            continue
        share = repeat_share(units, guard.ngram)
        if share > guard.max_repeat:
            flags.append(flag(ch.index, DEGENERATE, "repetition", round(share, 4), guard.max_repeat))
        logprobs = [lp for lp in ch.logprobs or () if lp is not None]  # completions' echo: None for the first
        if guard.min_surprisal is not None and logprobs:
            surprisal = mean_surprisal(logprobs)
            if surprisal < guard.min_surprisal:
                flags.append(flag(ch.index, DEGENERATE, "low_surprisal", round(surprisal, 4), guard.min_surprisal))
    return flags


def ended_flag(reason: str, value: float | None = None, threshold: float | None = None) -> dict:
    """The flag of a call refused because its episode ended (reason `max_turns` or `guard`)."""
    return flag(None, TRUNCATED, reason, value, threshold)


def ended_why(call_index: int, reason: str) -> str:
    """Why the guard ended an episode, as the refusals of its later calls say."""
    return f"the degenerate-output guard flagged call {call_index} ({reason})"


def degenerate(flags: Sequence[dict]) -> str | None:
    """The first degenerate finding's reason, if any."""
    return next((f["reason"] for f in flags if f["kind"] == DEGENERATE), None)
