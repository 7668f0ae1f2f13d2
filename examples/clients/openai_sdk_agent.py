"""The OpenAI Python SDK, two calls: a forced tool call, then a streamed answer that reads the tool's result.

A standalone agent with no harness imports. `OpenAI()` reads OPENAI_BASE_URL and OPENAI_API_KEY from the
environment; the model is named as the agent was written for it. It reads its task (`{"id": ..., "question":
...}`) from HARNESS_TASK, else from stdin. The last line on stdout is `{"answer": "..."}`; logs go to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/clients/openai_sdk_agent.py < <(head -1 examples/clients/tasks.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

MODEL = "gpt-4o-mini"
SYSTEM_PROMPT = "You solve arithmetic word problems. Use the add tool, then state the result."
# A tool with only integer arguments and `strict`: vLLM then constrains the call to the schema.
TOOLS = [{
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}]  # fmt: skip


def add(arguments: str) -> str:
    """The tool; a bad call comes back as an error text the model sees, never as an exception."""
    try:
        args = json.loads(arguments or "{}")
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, TypeError, KeyError) as exc:
        return f"error: {exc!r}"


def read_task() -> dict:
    """The task as the runner hands it over: HARNESS_TASK, else a JSON object on stdin."""
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    if not isinstance(task, dict) or not isinstance(task.get("question"), str):
        raise SystemExit(f"expected a JSON object with a 'question' string, got {task!r:.200}")
    return task


def main(client: OpenAI | None = None) -> None:
    """One episode; `client` defaults to `OpenAI()` (azure_openai_agent.py passes an AzureOpenAI)."""
    task = read_task()
    client = client or OpenAI()
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
    # Turn 1: a complete answer at once, with a tool call required.
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=256, temperature=0.8,
    ).choices[0].message  # fmt: skip
    messages.append(reply.model_dump(exclude_none=True))
    result = ""
    for call in reply.tool_calls or []:
        result = add(call.function.arguments)
        print(f"add({call.function.arguments}) -> {result}", file=sys.stderr)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # Turn 2: the answer streamed, chunk by chunk.
    text = []
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, temperature=0.8, stream=True,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    answer = "".join(text).strip() or result
    print(json.dumps({"id": task.get("id"), "answer": answer}))


if __name__ == "__main__":
    main()
