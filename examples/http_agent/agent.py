"""An agent with no SDK at all: two chat calls as raw HTTP, with `urllib.request` from the standard library.

It shows that the proxy records whatever speaks the OpenAI wire format, whatever the client library (curl,
Go, a shell script). A standalone program with no harness imports: it POSTs to
`$OPENAI_BASE_URL/chat/completions` with `Authorization: Bearer $OPENAI_API_KEY`, reads its task
(`{"id": ..., "question": ...}`) from HARNESS_TASK, else from stdin, and never looks at the task's `answer`.

Turn 1 answers the question; turn 2 asks the model to check that answer and state it briefly. The last line on
stdout is `{"answer": "..."}`, the second reply's text (the first's if the second is empty). Logs go to stderr.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
        python examples/http_agent/agent.py < <(head -1 examples/http_agent/tasks.jsonl)
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

MODEL = "qwen-plus"  # the model this agent was written for; the proxy serves its policy under any name
MAX_TOKENS = 48
TEMPERATURE = 0.8
TIMEOUT_S = 120
SYSTEM_PROMPT = "You answer questions in one short sentence."
CHECK_PROMPT = "Check your answer once more. Reply with the final answer only."


def chat(messages: list[dict]) -> str:
    """One POST /chat/completions; returns the reply's text ('' when the model wrote none)."""
    base_url = os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/")
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE}
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:  # say what the server said, then fail the episode
        detail = exc.read()[:500].decode(errors="replace")
        raise SystemExit(f"{request.full_url} answered {exc.code}: {detail}") from None
    choices = answer.get("choices") or [{}]
    return (choices[0].get("message") or {}).get("content") or ""


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
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    first = chat(messages)
    print(f"turn 0: {first!r}", file=sys.stderr)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": CHECK_PROMPT}]
    second = chat(messages)
    print(f"turn 1: {second!r}", file=sys.stderr)
    print(json.dumps({"id": task.get("id"), "answer": (second.strip() or first.strip())}))


if __name__ == "__main__":
    main()
