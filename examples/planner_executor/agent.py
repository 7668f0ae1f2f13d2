"""A planner and an executor, as a two-agent app in the wild writes them: each its own system prompt, each the model
it was written for, one OpenAI client, one base URL. The planner restates the word problem as an equation; the
executor, given only the planner's equation, answers with the number.

A standalone program with no harness imports: the OpenAI SDK reads OPENAI_BASE_URL and OPENAI_API_KEY, the task
(`{"id": ..., "question": ..., "answer": ...}`) comes from HARNESS_TASK or stdin, and the last line on stdout is
`{"answer": ...}`, the executor's reply. The two roles need opposite habits (judge.py): the planner is paid for an
equation that carries the problem's numbers, the executor for the number alone. examples/train/planner_executor.yaml
trains them as one policy each (roles.policies).

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/planner_executor/agent.py < <(head -1 examples/planner_executor/train.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

PLANNER_MODEL = "gpt-4o"  # the models this app was written for; the proxy serves its policies under any name
EXECUTOR_MODEL = "gpt-4o-mini"
PLANNER_PROMPT = "You are a planner. Restate the word problem as one equation with its numbers, like: 12 + 30 = ?"
EXECUTOR_PROMPT = "You carry out plans. Given an equation, reply with its result: the number alone."


def main() -> None:
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    client = OpenAI()
    temperature = float(os.environ.get("PLANNER_EXECUTOR_TEMPERATURE", "1.0"))
    plan = client.chat.completions.create(
        model=PLANNER_MODEL, max_tokens=32, temperature=temperature,
        messages=[{"role": "system", "content": PLANNER_PROMPT}, {"role": "user", "content": task["question"]}],
    ).choices[0].message.content or ""
    answer = client.chat.completions.create(
        model=EXECUTOR_MODEL, max_tokens=16, temperature=temperature,
        messages=[{"role": "system", "content": EXECUTOR_PROMPT}, {"role": "user", "content": plan}],
    ).choices[0].message.content or ""
    print(f"{task['question']} -> plan {plan!r} -> {answer!r}", file=sys.stderr)
    print(json.dumps({"id": task.get("id"), "answer": answer}))


if __name__ == "__main__":
    main()
