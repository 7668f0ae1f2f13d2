"""Talking to a family's model the way the engine tests do: an OpenAI-SDK call whose reply is forced to an exact
text, answered as an agent sees it (content, reasoning, tool calls), whole or streamed."""

from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add a number to the running total.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def ask(client, messages, regex: str, stream: bool, bias: dict, model: str = "gpt-4o-mini", **extra_body) -> dict:
    """One call, its reply forced to match `regex`; `bias` makes the family's markers single tokens, as a real
    model writes them (the regex alone lets the random model spell `</think>` out of BPE pieces)."""
    body = dict(model=model, messages=messages, tools=TOOLS, temperature=0.0, seed=1, max_tokens=120,
                logit_bias=bias, extra_body={"structured_outputs": {"regex": regex}, **extra_body})
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        message = choice.model_dump(exclude_none=True)["message"]
        return {"content": message.get("content"), "reasoning": message.get("reasoning"),
                "reasoning_content": message.get("reasoning_content"),
                "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                          for c in message.get("tool_calls") or ()],
                "ids": [c["id"] for c in message.get("tool_calls") or ()], "finish": choice.finish_reason}
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning", None) or (c.delta.model_extra or {}).get("reasoning") or ""
            for tc in c.delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [(calls[k]["name"], json.loads(calls[k]["arguments"])) for k in sorted(calls)],
            "ids": [calls[k]["id"] for k in sorted(calls)], "finish": finish}


def marker_bias(model) -> dict[str, int]:
    """Every added token of the model (its family's markers, its end of turn) -> a bias that makes it win wherever
    it may come; the other stop tokens (the tiny model's own, when the family ends turns otherwise) never win, so a
    reply ends on the family's close token, as a real model's does."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    stops = GenerationConfig.from_pretrained(model).eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops]) - {tokenizer.eos_token_id}
    own = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}  # the tiny model's
    return {str(i): -100 if i in stops & own else 100 for i in tokenizer.added_tokens_decoder}
