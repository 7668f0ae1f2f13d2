"""A two-turn chat agent for the training demo: it asks the model a question, then a follow-up.

A standalone program with no harness imports: the OpenAI SDK reads OPENAI_BASE_URL and OPENAI_API_KEY from the
environment, the task (`{"id": ..., "prompt": ..., "follow_up": ...}`) comes from HARNESS_TASK or stdin, and the
last line on stdout is `{"answer": ...}`: the two replies. The judge (judge.py) rewards terse replies, one short
word then the end of the turn, which a freshly initialised model does not write and learns by RL alone.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/terse_agent/agent.py < <(head -1 examples/terse_agent/tasks.jsonl)

TERSE_WAIT_S (default 0) makes each turn wait that many seconds first, as an agent waits on its environment (a
sandbox, a web tool, a user): bench/async_rollouts.py uses it for rollouts that are latency-bound, not compute-bound.
"""

from __future__ import annotations

import json
import os
import sys
import time

from openai import OpenAI

MODEL = "gpt-4o-mini"  # the model this agent was written for; the proxy serves its policy under any name
MAX_TOKENS = 8
SYSTEM_PROMPT = "Answer in one short word."
WAIT_S = float(os.environ.get("TERSE_WAIT_S", "0"))


def main() -> None:
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    client = OpenAI()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["prompt"]}]
    replies = []
    for turn in range(2):
        time.sleep(WAIT_S)  # the environment's latency (0 by default)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=1.0).choices[0].message.content or ""
        print(f"turn {turn}: {reply!r}", file=sys.stderr)
        replies.append(reply)
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": task.get("follow_up", "And why?")}]
    print(json.dumps({"id": task.get("id"), "answer": "\n".join(replies)}))


if __name__ == "__main__":
    main()
