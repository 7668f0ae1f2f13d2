"""A small agent written with the OpenAI SDK only: no harness imports, nothing to change to record it.

It answers a task in two turns (an answer, then a self-check), offering one calculator tool. Point it anywhere
OpenAI-compatible with OPENAI_BASE_URL; the model name is the one it was written for.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 python examples/simple_agent.py "What is 6 times 7?"
"""

import json
import sys

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]


def calculate(expression: str) -> str:
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        return "error: only arithmetic is allowed"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - characters checked above
    except Exception as exc:  # a tool error is an answer the model should see
        return f"error: {exc}"


def main(task: str) -> None:
    client = OpenAI()
    messages = [
        {"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."},
        {"role": "user", "content": task},
    ]
    for turn in range(2):
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, tools=TOOLS, max_tokens=48, temperature=0.8,
        ).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            try:
                args = json.loads(call.function.arguments)
                result = calculate(str(args.get("expression", "")))
            except (json.JSONDecodeError, AttributeError):
                result = "error: arguments were not a JSON object"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if turn == 0:
            messages.append({"role": "user", "content": "Check your answer once more and give it briefly."})
    print(json.dumps({"task": task, "answer": messages[-1].get("content")}))


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "What is 6 times 7?")
