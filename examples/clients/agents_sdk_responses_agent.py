"""The OpenAI Agents SDK (`openai-agents`) on its default model: `OpenAIResponsesModel`, the Responses API.

What most Agents SDK users run: an `Agent` whose model is a name, which the SDK's default provider serves with
`OpenAIResponsesModel` (`POST /v1/responses`). `set_default_openai_client(AsyncOpenAI())` points it at
OPENAI_BASE_URL with OPENAI_API_KEY, `set_default_openai_api("responses")` pins the Responses API (already the
SDK's default), and tracing is off (it would upload traces to OpenAI). The proxy serves /v1/responses by
translating each call into a chat completion, recorded with the engine's token ids (docs/proxy.md).

`Runner.run_sync` runs the loop and does not stream. Call 1 must call the `add` tool (`tool_choice="required"`);
the SDK runs it, resets the choice to auto and calls the model again with the result. The final answer is
structured (`output_type=Answer`, sent as `text.format` json_schema): a real model would answer in prose too, but
the SDK fails a run whose response comes back `incomplete` (cut off at `max_output_tokens`), and the random tiny
test model rarely ends a prose reply on its own. Held to a small JSON object by the engine, its answer ends well
inside `max_tokens`.

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
    Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_default_openai_client,
    set_tracing_disabled,
)  # fmt: skip
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

MODEL = "gpt-4.1-mini"
MAX_TURNS = 3  # model calls per episode, at most
INSTRUCTIONS = "You solve arithmetic word problems. Use the add tool, then give the result."


class Answer(BaseModel):
    result: int = Field(description="The number that answers the question.")


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
        output_type=Answer,
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
        answer = str(result.final_output_as(Answer).result)
    except MaxTurnsExceeded as exc:  # the model kept calling the tool: no final answer, still an episode
        print(f"no answer: {exc}", file=sys.stderr)
        answer = ""
    print(json.dumps({"id": task.get("id"), "answer": answer}))


if __name__ == "__main__":
    main()
