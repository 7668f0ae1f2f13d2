"""A ReAct agent built with AgentScope 2.x, recorded through the proxy without changing a line of it.

AgentScope's `Agent` runs the reasoning-acting loop itself: it calls the model with the registered tools,
executes the tool calls it gets back, and calls the model again, until a reply has no tool call. Its
`OpenAIChatModel` streams by default, and the proxy records the stream. Nothing here knows about the harness:
the model is pointed at OPENAI_BASE_URL / OPENAI_API_KEY, as any AgentScope program pointed at an
OpenAI-compatible server would be.

Settings that keep it well-behaved under a small or random policy (the harness's tiny test model emits
gibberish): at most MAX_ITERS reasoning-acting rounds, plus the one forced final call AgentScope makes
without tools once they are used up; short replies; and no runtime-state injection, which would put the
current time into every prompt (so repeats of one task would not share their prompt). AgentScope itself turns
an unknown tool name or unparseable arguments into an error tool result.

It reads its task (`{"id": ..., "question": ...}`) from HARNESS_TASK, else from stdin, and never looks at the
task's `answer`. The last line on stdout is `{"answer": "..."}`: the text of the agent's final message.
AgentScope logs to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/agentscope_agent/agent.py < <(head -1 examples/agentscope_agent/tasks.jsonl)
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import sys

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.credential import OpenAICredential
from agentscope.message import UserMsg
from agentscope.model import OpenAIChatModel
from agentscope.permission import PermissionBehavior, PermissionDecision
from agentscope.tool import FunctionTool, Toolkit

MODEL = "qwen-plus"  # the model this agent was written for; the proxy serves its policy under any name
MAX_ITERS = 3  # reasoning-acting rounds; AgentScope adds one tool-less final call when they run out
MAX_TOKENS = 48
TEMPERATURE = 0.8
SYSTEM_PROMPT = (
    "You solve math word problems. Use the calculator tool for arithmetic, then reply with the final number."
)

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip
_MAX_EXPONENT = 100  # 9**9**9 would hang the agent; no word problem needs more


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression (`str`):
            The expression to evaluate, e.g. "(48 / 2) + 48".
    """

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic")

    try:
        result = value(ast.parse(str(expression).strip(), mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def build_agent() -> Agent:
    model = OpenAIChatModel(
        credential=OpenAICredential(
            api_key=os.environ.get("OPENAI_API_KEY", "sk-none"), base_url=os.environ.get("OPENAI_BASE_URL"),
        ),
        model=MODEL,
        parameters=OpenAIChatModel.Parameters(max_tokens=MAX_TOKENS, temperature=TEMPERATURE),
    )  # fmt: skip
    # A custom function tool asks the user before each call unless it is allowed up front; no user is here.
    allowed = PermissionDecision(behavior=PermissionBehavior.ALLOW, message="The calculator has no side effects.")
    return Agent(
        name="solver",
        system_prompt=SYSTEM_PROMPT,
        model=model,
        toolkit=Toolkit(tools=[FunctionTool(calculator, is_read_only=True, permission=allowed)]),
        react_config=ReActConfig(max_iters=MAX_ITERS),
        injection_config=InjectionConfig(inject_runtime_state=False),
    )


def read_task() -> dict:
    """The task as the runner hands it over: HARNESS_TASK, else a JSON object on stdin."""
    raw = os.environ.get("HARNESS_TASK") or sys.stdin.read()
    task = json.loads(raw)
    if not isinstance(task, dict):
        raise SystemExit(f"expected the task as a JSON object, got {raw[:200]!r}")
    return task


async def main() -> None:
    task = read_task()
    question = task.get("question") or task.get("prompt")
    if not isinstance(question, str):
        raise SystemExit(f"task {task.get('id')!r} has no 'question' string; keys: {sorted(task)}")
    reply = await build_agent().reply(UserMsg(name="user", content=question))
    answer = (reply.get_text_content() or "").strip()
    print(json.dumps({"id": task.get("id"), "answer": answer}))


if __name__ == "__main__":
    asyncio.run(main())
