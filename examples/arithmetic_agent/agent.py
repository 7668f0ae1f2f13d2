"""An arithmetic agent: it asks the model a sum and passes the reply on as its answer.

A standalone program with no harness imports, like any agent in the wild: the OpenAI SDK reads OPENAI_BASE_URL
and OPENAI_API_KEY from the environment, the task (`{"id": ..., "question": ..., "answer": ...}`) comes from
HARNESS_TASK or stdin, and the last line on stdout is `{"answer": ...}`. The judge (judge.py) wants the number
alone, which SmolLM2-135M-Instruct as shipped does not write ("The answer is 12.", "7 + 5 = 12"): the config
examples/train/arithmetic.yaml teaches it by RL.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/arithmetic_agent/agent.py < <(head -1 examples/arithmetic_agent/train.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

MODEL = "gpt-4o-mini"  # the model this agent was written for; the proxy serves its policy under any name
SYSTEM_PROMPT = "You are a calculator. Reply with the number only."
MAX_TOKENS = 24


def main() -> None:
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    reply = OpenAI().chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, temperature=float(os.environ.get("ARITHMETIC_TEMPERATURE", "1.0")),
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}],
    ).choices[0].message.content or ""
    print(f"{task['question']} -> {reply!r}", file=sys.stderr)
    print(json.dumps({"id": task.get("id"), "answer": reply}))


if __name__ == "__main__":
    main()
