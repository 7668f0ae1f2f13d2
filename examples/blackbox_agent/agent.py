"""A black-box agent: it hard-codes its vendor's URL and key, and ignores OPENAI_BASE_URL.

Agents like this are common (a vendor SDK set up in code, a compiled tool, a third-party app). `harness run
--transparent` records them anyway: the agent's HTTPS traffic goes through the embedded mitmproxy, which sends
calls for known LLM hosts to the recording proxy and tunnels everything else untouched. Nothing here knows.

The task (`{"id": ..., "question" (or "prompt"): ..., "vendor": "openai" | "dashscope" | "deepseek"}`) comes in
HARNESS_TASK or on stdin. Two calls: a streamed answer, then a non-streamed check. The last stdout line is
`{"answer": ...}`.
"""

import json
import os
import sys

from openai import OpenAI

VENDORS = {  # what real code hard-codes: the vendor's base URL, its model name, a key from its console
    "openai": ("https://api.openai.com/v1", "gpt-4o-mini"),
    "dashscope": ("https://dashscope.aliyuncs.com/compatible-mode/v1", "qwen-plus"),
    "deepseek": ("https://api.deepseek.com", "deepseek-chat"),
}
HARD_CODED_KEY = "sk-hardcoded-0000-not-a-real-key"  # never reaches the recorder: the hop swaps it out


def main() -> None:
    task = json.loads(os.environ.get("HARNESS_TASK") or sys.stdin.read())
    base_url, model = VENDORS[task.get("vendor", "openai")]
    client = OpenAI(base_url=base_url, api_key=HARD_CODED_KEY, max_retries=0)
    messages = [{"role": "system", "content": "Answer with one number."},
                {"role": "user", "content": task.get("question") or task["prompt"]}]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24, stream=True)
    first = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Check it. Final number?"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24)
    print(f"first: {first!r}", file=sys.stderr)
    print(json.dumps({"answer": reply.choices[0].message.content or first}))


if __name__ == "__main__":
    main()
