"""Each role of examples/planner_executor its own reward (`role_rewards`), for habits that pull apart.

    planner   0.5 x (an equation: two numbers joined by + - * / x, or a number and an "=")
              + 0.5 x (the share of the question's numbers the plan carries)
    executor  1.0 for the right number alone ("28", "28."); else 0.5 x right + 0.4 x max(0, 1 - chars / 40)

`right` is the executor's last number being the task's answer. The episode's reward is the executor's (the app's
answer). The planner is paid to write more (the problem's numbers, an operator), the executor to write less, so
one policy serving both is pulled two ways; one policy per role (roles.policies) is not. Calls carry their role's
name (`role`) when roles are named, so the judge reads each role's replies without knowing the prompts.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")
_BARE = re.compile(r"-?\d+\.?")
_EQUATION = re.compile(r"\d+\s*[-+*/x×]\s*\d+|\d+\s*=|=\s*\d+")


def _replies(calls: list[dict], role: str) -> list[str]:
    return [(choice.get("message") or {}).get("content") or "" for call in calls if call.get("role") == role
            for choice in (call.get("response") or {}).get("choices") or ()]


def planner_reward(question: str, plan: str) -> float:
    wanted = set(_NUMBER.findall(question))
    carried = len(wanted & set(_NUMBER.findall(plan))) / len(wanted) if wanted else 0.0
    return 0.5 * bool(_EQUATION.search(plan)) + 0.5 * carried


def executor_reward(expected: str, reply: str) -> dict:
    text = reply.strip()
    numbers = _NUMBER.findall(text)
    right = bool(numbers) and int(numbers[-1]) == int(expected)
    if right and _BARE.fullmatch(text):
        return {"reward": 1.0, "right": True}
    return {"reward": round(0.5 * right + 0.4 * max(0.0, 1.0 - len(text) / 40) if text else 0.0, 6), "right": right}


def planner_and_executor(task: dict, answer: str | None, calls: list[dict]) -> dict:
    plans = _replies(calls, "planner")
    planner = sum(planner_reward(task["question"], p) for p in plans) / len(plans) if plans else 0.0
    executor = executor_reward(task["answer"], answer or "")
    return {"reward": executor["reward"], "role_rewards": {"planner": round(planner, 6),
                                                           "executor": executor["reward"]},
            "right": executor["right"], "planner": round(planner, 6)}
