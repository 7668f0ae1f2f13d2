"""LiteLLM's `completion()`, the OpenAI-compatible route: a forced tool call, then a streamed answer that reads
the tool's result.

A standalone agent with no harness imports. LiteLLM reaches any OpenAI-compatible server as
`model="openai/<name>"` with `api_base`; it sends `<name>` on the wire. The base URL and key come from
OPENAI_BASE_URL and OPENAI_API_KEY. LiteLLM fetches its model price list from GitHub at import unless told to
use the copy it ships (LITELLM_LOCAL_MODEL_COST_MAP), which is what an agent running offline does.

It reads its task (`{"id": ..., "question": ...}`) from HARNESS_TASK, else from stdin. The last line on stdout is
`{"answer": "..."}`; logs go to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/clients/litellm_agent.py < <(head -1 examples/clients/tasks.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: the price list LiteLLM ships

import litellm  # noqa: E402 - reads the setting above at import

MODEL = "openai/gpt-4o-mini"  # provider "openai" (any OpenAI-compatible server), model "gpt-4o-mini"
SYSTEM_PROMPT = "You solve arithmetic word problems. Use the add tool, then state the result."
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
        "strict": True,  # vLLM constrains the call's arguments to the schema
    },
}]  # fmt: skip


def add(arguments: str) -> str:
    """The tool; a bad call comes back as an error text the model sees, never as an exception."""
    try:
        args = json.loads(arguments or "{}")
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, TypeError, KeyError) as exc:
        return f"error: {exc!r}"


def complete(messages: list[dict], **kwargs):
    return litellm.completion(
        model=MODEL, api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "sk-none"),
        messages=messages, tools=TOOLS, temperature=0.8, num_retries=0, **kwargs,
    )  # fmt: skip


def read_task() -> dict:
    """The task as the runner hands it over: HARNESS_TASK, else a JSON object on stdin."""
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    if not isinstance(task, dict) or not isinstance(task.get("question"), str):
        raise SystemExit(f"expected a JSON object with a 'question' string, got {task!r:.200}")
    return task


def main() -> None:
    task = read_task()
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
    # Turn 1: the whole reply at once, with a tool call required.
    reply = complete(messages, tool_choice="required", parallel_tool_calls=False, max_tokens=256).choices[0].message
    calls = reply.tool_calls or []
    assistant = {"role": "assistant", "content": reply.content or ""}
    if calls:
        assistant["tool_calls"] = [call.model_dump() for call in calls]
    messages.append(assistant)
    result = ""
    for call in calls:
        result = add(call.function.arguments)
        print(f"add({call.function.arguments}) -> {result}", file=sys.stderr)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # Turn 2: the answer, streamed.
    text = []
    for chunk in complete(messages, max_tokens=48, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    answer = "".join(text).strip() or result
    print(json.dumps({"id": task.get("id"), "answer": answer}))


if __name__ == "__main__":
    main()
