"""The OpenAI Agents SDK (`openai-agents`): an `Agent` with one function tool, run by `Runner.run_sync`.

The SDK runs the loop itself: it calls the model, runs the tool calls it gets back, and calls the model again
with their results until a reply has no tool call. The model is `OpenAIChatCompletionsModel` over an
`AsyncOpenAI()` client, which reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment; tracing is off
(it would upload traces to OpenAI). The first call must call the tool (`tool_choice="required"`); the SDK resets
the choice to auto once the tool has been used, so the next call can answer.

A standalone agent with no harness imports. It reads its task (`{"id": ..., "question": ...}`) from
HARNESS_TASK, else from stdin. The last line on stdout is `{"answer": "..."}`; logs go to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/clients/agents_sdk_agent.py < <(head -1 examples/clients/tasks.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

MODEL = "gpt-4.1-mini"
MAX_TURNS = 3  # model calls per episode, at most
INSTRUCTIONS = "You solve arithmetic word problems. Use the add tool, then state the result."


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    print(f"add({a}, {b})", file=sys.stderr)
    return a + b


def build_agent() -> Agent:
    set_tracing_disabled(True)
    return Agent(
        name="solver",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI()),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=256, temperature=0.8,
        ),
        tools=[add],  # function tools are strict: vLLM constrains the arguments to their schema
    )  # fmt: skip


def read_task() -> dict:
    """The task as the runner hands it over: HARNESS_TASK, else a JSON object on stdin."""
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    if not isinstance(task, dict) or not isinstance(task.get("question"), str):
        raise SystemExit(f"expected a JSON object with a 'question' string, got {task!r:.200}")
    return task


def main() -> None:
    task = read_task()
    try:
        result = Runner.run_sync(build_agent(), task["question"], max_turns=MAX_TURNS)
        answer = str(result.final_output or "").strip()
    except MaxTurnsExceeded as exc:  # the model kept calling the tool: no final answer, still an episode
        print(f"no answer: {exc}", file=sys.stderr)
        answer = ""
    print(json.dumps({"id": task.get("id"), "answer": answer}))


if __name__ == "__main__":
    main()
