"""A per-role judge for the solver + critic app: each named role gets its own reward.

The solver scores 0.5 for a correct final number (GSM8K-style reference, "#### 90") plus 0.5 x the brevity of its
replies (a reply of n characters scores max(0, 1 - (n - 1) / 48): short, decided answers). The critic is judged on
brevity alone. The episode's reward is the solver's. A tiny random model never gets the number right, but its
replies vary in length, so the solver's signal is dense from the first step; a real model earns the other half.

Calls carry their role's name (`role`) when roles are named (examples/train/multi_agent.yaml: roles.match), so
the judge needs no knowledge of the agent's prompts.
"""

from __future__ import annotations

import re

SCALE = 48


def _brevity(text: str) -> float:
    n = len(text.strip())
    return 0.0 if n == 0 else max(0.0, 1.0 - (n - 1) / SCALE)


def _replies(calls: list[dict], role: str) -> list[str]:
    out = []
    for call in calls:
        if call.get("role") != role:
            continue
        for choice in (call.get("response") or {}).get("choices") or ():
            out.append((choice.get("message") or {}).get("content") or "")
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def solver_and_critic(task: dict, answer: str | None, calls: list[dict]) -> dict:
    expected = str(task.get("answer", "")).split("####")[-1].strip()
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer or "")
    correct = bool(expected) and bool(numbers) and numbers[-1] == expected
    solver = 0.5 * correct + 0.5 * _mean([_brevity(r) for r in _replies(calls, "solver")])
    critic = _mean([_brevity(r) for r in _replies(calls, "critic")])
    return {"reward": solver, "role_rewards": {"solver": solver, "critic": critic}, "correct": correct}
