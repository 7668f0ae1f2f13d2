"""A scripted degenerate agent for the guard's tests: on a degenerate episode, logit_bias pins one token, so the
model repeats it until max_tokens; otherwise it chats normally. `turns` calls per episode (default 4), every other
one streamed; the answer is always "done".

The task's "degenerate": true (every episode), false (none), or "odd" (episodes whose repeat index is odd: half of
each GRPO group). With "fresh": true, every turn starts a new conversation, so each call is a sample of its own.
"""

import json
import os
import re

from openai import OpenAI

task = json.loads(os.environ["HARNESS_TASK"])
mode = task.get("degenerate")
repeat = int(re.search(r"-(\d+)(?:-retry\d+)?$", os.environ["HARNESS_EPISODE_ID"]).group(1))  # <run>-<task>-<repeat>
bias = {"100": 100} if mode is True or (mode == "odd" and repeat % 2) else None
client = OpenAI(max_retries=0)
messages = [{"role": "user", "content": task["prompt"]}]
for turn in range(task.get("turns", 4)):
    stream = turn % 2 == 1
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=40, logit_bias=bias,
                                           stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else \
        reply.choices[0].message.content
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    if task.get("fresh"):
        messages = [{"role": "user", "content": f"{task['prompt']} ({turn + 1})"}]
print(json.dumps({"answer": "done"}))
