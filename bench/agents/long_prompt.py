"""An agent shaped like the ones in the wild, for bench/train_layouts.py: a long system prompt (rules and worked
examples, ~1,500 tokens), then three calls, each prompt the one before with the reply and a tool's result appended.

A standalone program (the OpenAI SDK reads OPENAI_BASE_URL; the task comes from HARNESS_TASK or stdin; the last
line on stdout is `{"answer": ...}`), as `harness run` runs any agent.
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

RULES = [
    "Read the whole question before you answer, and answer the question that was asked.",
    "Work step by step: write each intermediate number on its own line.",
    "When a tool result arrives, check it against your own working before you rely on it.",
    "Never invent a tool result; ask for the tool again if a result is missing.",
    "Keep units with every number, and convert units before you add or compare.",
    "Round only at the end, to the precision the question asks for.",
    "If the question is ambiguous, say which reading you chose and why, in one sentence.",
    "Finish with a line that starts with 'Answer:' and holds the answer alone.",
]
NAMES = ["apples", "boxes", "litres", "metres", "tickets", "coins", "pages", "trains", "hours", "stamps"]


def system_prompt() -> str:
    """Instructions and worked examples, the same for every task (as an agent ships them)."""
    lines = ["You are a careful assistant that solves word problems with a calculator tool.", "", "Rules:"]
    lines += [f"{k}. {rule}" for k, rule in enumerate(RULES, 1)]
    lines += ["", "Worked examples:"]
    for k in range(20):
        a, b, thing = 3 + 7 * k, 5 + 11 * k, NAMES[k % len(NAMES)]
        lines += [f"Example {k + 1}. Question: A shelf holds {a} {thing} and another holds {b} {thing}. How many "
                  f"{thing} are there in all?",
                  f"Working: {a} + {b} = {a + b}. The calculator agrees: {a + b}.",
                  f"Answer: {a + b} {thing}", ""]
    return "\n".join(lines)


def main() -> None:
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    client = OpenAI()
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": task["question"]}]
    follow_ups = ["Tool result: the calculator returned the sum you asked for. Continue.", "Now give the answer."]
    reply = ""
    for turn in range(3):
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, max_tokens=int(os.environ.get("AGENT_MAX_TOKENS", "32")),
            temperature=1.0).choices[0].message.content or ""
        if turn < 2:
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_ups[turn]}]
    print(json.dumps({"id": task.get("id"), "answer": reply}))


if __name__ == "__main__":
    main()
