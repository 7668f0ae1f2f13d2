"""The OpenAI Agents SDK (`openai-agents`) on its default model: `OpenAIResponsesModel`, the Responses API.

What most Agents SDK users run: an `Agent` whose model is a name, which the SDK's default provider serves with
`OpenAIResponsesModel` (`POST /v1/responses`). `set_default_openai_client(AsyncOpenAI())` points it at
OPENAI_BASE_URL with OPENAI_API_KEY, `set_default_openai_api("responses")` pins the Responses API (already the
SDK's default), and tracing is off (it would upload traces to OpenAI). The proxy serves /v1/responses by
translating each call into a chat completion, recorded with the engine's token ids (docs/proxy.md).

`Runner.run_sync` runs the loop with `responses.create` and does not stream. The one model call must call the
`add` tool (`tool_choice="required"`); the SDK runs it, and the tool's result is the answer
(`tool_use_behavior="stop_on_first_tool"`): no second call. Why not a second call that states the result, as the
Chat Completions example makes: this model class fails the run (ModelBehaviorError) on a response that comes
back `incomplete`, cut off at `max_output_tokens`, and the random tiny test model often writes past any limit
before it ends a reply (about 1 reply in 5 runs past 1500 tokens). The forced call is bounded: vLLM constrains
it to the tool's strict schema, so it ends well inside `max_tokens`.

A standalone agent with no harness imports. It reads its task (`{"id": ..., "question": ...}`) from
HARNESS_TASK, else from stdin. The last line on stdout is `{"id": ..., "answer": "..."}`; logs go to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/clients/agents_sdk_responses_agent.py < <(head -1 examples/clients/tasks.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

MODEL = "gpt-4.1-mini"
MAX_TURNS = 1  # model calls per episode: the first tool call ends the run
INSTRUCTIONS = "You solve arithmetic word problems. Answer with the add tool: its result is your answer."


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
    set_default_openai_client(AsyncOpenAI(), use_for_tracing=False)  # reads OPENAI_BASE_URL, OPENAI_API_KEY
    set_default_openai_api("responses")
    return Agent(
        name="solver",
        instructions=INSTRUCTIONS,
        model=MODEL,  # a name: the default provider serves it with OpenAIResponsesModel
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=512, temperature=0.8,
        ),
        tools=[add],  # function tools are strict: vLLM constrains the arguments to their schema
        tool_use_behavior="stop_on_first_tool",  # the tool's result is the final output
    )  # fmt: skip


def read_task() -> dict:
    """The task as the runner hands it over: HARNESS_TASK, else a JSON object on stdin."""
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    if not isinstance(task, dict) or not isinstance(task.get("question"), str):
        raise SystemExit(f"expected a JSON object with a 'question' string, got {task!r:.200}")
    return task


def main() -> None:
    task = read_task()
    result = Runner.run_sync(build_agent(), task["question"], max_turns=MAX_TURNS)
    answer = str(result.final_output).strip()
    print(json.dumps({"id": task.get("id"), "answer": answer}))


if __name__ == "__main__":
    main()
