"""LangChain's `ChatOpenAI`, with a tool bound by `bind_tools`: a forced tool call, the tool run, then a streamed
answer that reads its result.

A standalone agent with no harness imports. `ChatOpenAI` builds an OpenAI client, which reads OPENAI_BASE_URL and
OPENAI_API_KEY from the environment. It reads its task (`{"id": ..., "question": ...}`) from HARNESS_TASK, else
from stdin. The last line on stdout is `{"answer": "..."}`; logs go to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/clients/langchain_agent.py < <(head -1 examples/clients/tasks.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

MODEL = "gpt-4o"
SYSTEM_PROMPT = "You solve arithmetic word problems. Use the add tool, then state the result."


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def read_task() -> dict:
    """The task as the runner hands it over: HARNESS_TASK, else a JSON object on stdin."""
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    if not isinstance(task, dict) or not isinstance(task.get("question"), str):
        raise SystemExit(f"expected a JSON object with a 'question' string, got {task!r:.200}")
    return task


def main() -> None:
    task = read_task()
    # strict: vLLM constrains the arguments to the tool's schema (integers only here).
    forced = ChatOpenAI(model=MODEL, temperature=0.8, max_tokens=256).bind_tools(
        [add], tool_choice="required", strict=True, parallel_tool_calls=False,
    )  # fmt: skip
    messages = [SystemMessage(SYSTEM_PROMPT), HumanMessage(task["question"])]
    reply = forced.invoke(messages)
    messages.append(reply)
    result = ""
    for call in reply.tool_calls:
        try:
            result = str(add.invoke(call["args"]))
        except Exception as exc:  # noqa: BLE001 - a bad call is an answer the model should see
            result = f"error: {exc}"
        print(f"add({call['args']}) -> {result}", file=sys.stderr)
        messages.append(ToolMessage(result, tool_call_id=call["id"]))
    # The answer, streamed; the tool stays offered, the model is free not to call it.
    llm = ChatOpenAI(model=MODEL, temperature=0.8, max_tokens=48).bind_tools([add], strict=True)
    answer = "".join(chunk.text for chunk in llm.stream(messages)).strip()
    print(json.dumps({"id": task.get("id"), "answer": answer or result}))


if __name__ == "__main__":
    main()
