"""The summary of a dataset run: pure functions from outcomes, judgements and call statistics to one dict.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of a task of which c succeeded,
pass@k = 1 - C(n - c, k) / C(n, k), averaged over the tasks that have at least k samples.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb

from harness.core.records import FINISHED, EpisodeOutcome, Judgement


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def percentiles(values: Sequence[float], qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """Nearest-rank-with-interpolation percentiles, keyed "p50", "p90", ..."""
    ordered = sorted(v for v in values if v is not None)
    out: dict[str, float | None] = {}
    for q in qs:
        key = f"p{round(q * 100):d}"
        if not ordered:
            out[key] = None
            continue
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out[key] = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return out


def build_report(
    outcomes: Sequence[EpisodeOutcome],
    judgements: Sequence[Judgement],
    *,
    judge: str,
    success_threshold: float = 1.0,
    episode_tokens: dict[str, tuple[int, int]] | None = None,
    call_latencies_ms: Sequence[float] = (),
    flagged: dict[str, int] | None = None,
) -> dict:
    """One run under one judge. `episode_tokens`: episode_id -> (prompt tokens, completion tokens); `flagged`:
    "kind:reason" (the flags view) -> episodes with such a flag."""
    by_episode = {j.episode_id: j for j in judgements if j.judge == judge}
    rewards = [j.reward for j in by_episode.values() if j.reward is not None]
    per_task: dict[str, list[bool]] = {}
    for o in outcomes:
        j = by_episode.get(o.episode_id)
        per_task.setdefault(o.task_id, []).append(j is not None and j.reward is not None
                                                  and j.reward >= success_threshold)
    max_n = max((len(v) for v in per_task.values()), default=0)
    pass_k = {}
    for k in range(1, max_n + 1):
        eligible = [pass_at_k(len(v), sum(v), k) for v in per_task.values() if len(v) >= k]
        pass_k[f"pass@{k}"] = sum(eligible) / len(eligible) if eligible else None

    failures = Counter(o.status for o in outcomes if o.status != FINISHED)
    judge_errors = sum(1 for j in by_episode.values() if j.error)
    if judge_errors:
        failures["judge_error"] = judge_errors
    tokens = episode_tokens or {}
    successes = sum(sum(v) for v in per_task.values())
    return {
        "judge": judge,
        "episodes": len(outcomes),
        "tasks": len(per_task),
        "judged": len(rewards),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "success_threshold": success_threshold,
        "success_rate": successes / len(outcomes) if outcomes else None,
        "pass_at_k": pass_k,
        "failures": dict(sorted(failures.items())),
        "flagged_episodes": dict(sorted((flagged or {}).items())),
        "prompt_tokens_per_episode": percentiles([t[0] for t in tokens.values()]),
        "completion_tokens_per_episode": percentiles([t[1] for t in tokens.values()]),
        "call_latency_ms": percentiles(call_latencies_ms),
        "episode_duration_ms": percentiles([o.duration_ms for o in outcomes]),
    }


def print_report(report: dict, run_id: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"
        return str(v)

    table = Table(title=f"run {run_id} · judge {report['judge']}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    table.add_row("episodes / tasks", f"{report['episodes']} / {report['tasks']}")
    table.add_row("mean reward", fmt(report["mean_reward"]))
    table.add_row(f"success rate (reward >= {report['success_threshold']:g})", fmt(report["success_rate"]))
    for k, v in report["pass_at_k"].items():
        table.add_row(k, fmt(v))
    table.add_row("failures", ", ".join(f"{k}: {v}" for k, v in report["failures"].items()) or "none")
    if report.get("flagged_episodes"):  # cut short (truncated:...) or found degenerate by the guard
        table.add_row("episodes flagged", ", ".join(f"{k}: {v}" for k, v in report["flagged_episodes"].items()))
    for key, label in (("prompt_tokens_per_episode", "prompt tokens / episode"),
                       ("completion_tokens_per_episode", "completion tokens / episode"),
                       ("call_latency_ms", "call latency ms"), ("episode_duration_ms", "episode duration ms")):
        table.add_row(label, format_percentiles(report[key]))
    Console().print(table)


def format_percentiles(values: dict[str, float | None]) -> str:
    """One row of percentiles, every value with the same decimals (chosen by the largest): `p50 96  p90 104`, never
    `p50 96.000  p90 104`. Whole numbers (token counts) print without decimals."""
    present = [abs(v) for v in values.values() if v is not None]
    largest = max(present, default=0.0)
    whole = all(float(v).is_integer() for v in present)
    decimals = 0 if whole or largest >= 100 else 1 if largest >= 10 else 3
    return "  ".join(f"{q} {'-' if v is None else f'{v:.{decimals}f}'}" for q, v in values.items())
