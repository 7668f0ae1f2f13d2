"""Two agents in one process: a solver answers, a critic reviews, the solver revises once.

Both talk to the same OPENAI_BASE_URL (the OpenAI SDK reads it and OPENAI_API_KEY from the environment), but
each has its own system prompt and the critic names its own model. The proxy fingerprints every call by
(model name, system prompt, tool set), so the episode's three calls carry two roles: `role_key` in the
`calls` table tells the solver's two calls from the critic's one, and a trainer can weigh or filter them apart.

A standalone program with no harness imports. It reads its task (`{"id": ..., "question": ...}`) from
HARNESS_TASK, else from stdin, and never looks at the task's `answer`. The last line on stdout is
`{"answer": "..."}`: the solver's revision (its first answer if the revision is empty). Logs go to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/multi_agent/agent.py < <(head -1 examples/multi_agent/tasks.jsonl)
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from openai import OpenAI

MAX_TOKENS = 48
TEMPERATURE = 0.8


@dataclass
class ChatAgent:
    """One participant: a model name, a system prompt, and the conversation it has seen so far."""

    name: str
    model: str
    system_prompt: str
    client: OpenAI
    history: list[dict] = field(default_factory=list)

    def say(self, message: str) -> str:
        """Send one user message, remember the exchange, and return the reply text ('' if there is none)."""
        self.history.append({"role": "user", "content": message})
        reply = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "system", "content": self.system_prompt}, *self.history],
            max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
        ).choices[0].message  # fmt: skip
        text = (reply.content or "").strip()
        self.history.append({"role": "assistant", "content": text})
        print(f"{self.name}: {text!r}", file=sys.stderr)
        return text


def solve(client: OpenAI, question: str) -> str:
    solver = ChatAgent("solver", "gpt-4o-mini", "You solve math word problems. Answer with the final number.", client)
    critic = ChatAgent(
        "critic", "critic-model",
        "You review a proposed answer to a math word problem. Point out any mistake in one sentence.", client,
    )  # fmt: skip
    first = solver.say(question)
    review = critic.say(f"Problem: {question}\nProposed answer: {first}")
    revised = solver.say(f"A reviewer said: {review}\nGive your final answer as a number.")
    return revised or first


def read_task() -> dict:
    """The task as the runner hands it over: HARNESS_TASK, else a JSON object on stdin."""
    raw = os.environ.get("HARNESS_TASK") or sys.stdin.read()
    task = json.loads(raw)
    if not isinstance(task, dict):
        raise SystemExit(f"expected the task as a JSON object, got {raw[:200]!r}")
    return task


def main() -> None:
    task = read_task()
    question = task.get("question") or task.get("prompt")
    if not isinstance(question, str):
        raise SystemExit(f"task {task.get('id')!r} has no 'question' string; keys: {sorted(task)}")
    print(json.dumps({"id": task.get("id"), "answer": solve(OpenAI(), question)}))


if __name__ == "__main__":
    main()
