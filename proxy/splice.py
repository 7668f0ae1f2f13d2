"""The splice: the prompt ids of a call that continues an earlier reply (proxy/continuity.py finds which reply).

The parent's recorded prompt and completion ids, then the engine's render of what follows the parent's reply (from
/tokenize, which renders as the engine's chat endpoint does), cut after the template's turn end. A reply that
reasoned is also rendered without its reasoning, to tell whether the template drops it from the history; the
`reasoning_history` choice says what happens then (docs/proxy.md, "Reasoning in the history").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import orjson

from harness.core.merge import DROPS_REASONING
from proxy.engine_client import HttpClient

if TYPE_CHECKING:
    from proxy.continuity import Parent, Timelines

# Fallback reasons the splice gives (Call.extra["continuity"]["reason"]; proxy/continuity.py has the others).
RENDER_FAILED = "render_failed"  # the engine could not render the conversation (/tokenize failed)
NOT_APPEND_ONLY = "template_not_append_only"  # rendering the new messages changed the rendering before them
CLOSE_TOKEN_NOT_RENDERED = "close_token_not_rendered"  # the template's turn end was not found after the reply
PROMPT_TOO_LONG = "prompt_too_long"  # the spliced prompt leaves no room to generate
# DROPS_REASONING (harness/core/merge.py): the reply's reasoning is not in the history the template renders

# How a reply's sampled reasoning is treated when the template leaves it out of the history it renders (Qwen3
# drops reasoning of turns before the last user message): docs/proxy.md, "Reasoning in the history".
AS_RENDERED = "as_rendered"  # a new timeline on the rendered history: trained on what the model is served
KEEP = "keep"  # continue token-exactly with the sampled reasoning kept in context: one sample per episode
REASONING_HISTORY = (AS_RENDERED, KEEP)


@dataclass
class Plan:
    """How one chat call is served: token-exact (prompt ids + completions body) or by chat rendering, and why."""

    mode: str  # "token_exact" or "chat"
    reason: str | None = None  # why not token-exact
    detail: dict = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    max_model_len: int | None = None

    def record(self) -> dict:
        out = {"mode": self.mode}
        if self.reason:
            out["reason"] = self.reason
        out.update(self.detail)
        return out


async def splice(timelines: Timelines, session: HttpClient, base_url: str, body: dict, parent: Parent,
                 reply_index: int, timeout_s: float = 30.0) -> Plan:
    """Build the prompt ids: the parent's recorded ids, then the engine's render of everything after the parent's
    reply (from /tokenize, which renders exactly as the engine's chat endpoint does)."""
    messages = _as_chat_renders(body["messages"])
    common = {"model": body.get("model"), "tools": body.get("tools"),
              "chat_template_kwargs": body.get("chat_template_kwargs")}
    full_req = {**common, "messages": messages, "add_generation_prompt": True}
    head_req = {**common, "messages": messages[:reply_index + 1], "add_generation_prompt": False}
    # A reply that reasoned: the head without any reasoning tells whether the template renders it at all.
    bare = [_without_reasoning(m) for m in messages[:reply_index + 1]] if parent.reasoned else None
    try:
        full, head, turn_end, *bare_head = await asyncio.gather(
            _tokenize(session, base_url, full_req, timeout_s), _tokenize(session, base_url, head_req, timeout_s),
            _turn_end(timelines, session, base_url, common, timeout_s),
            *([_tokenize(session, base_url, {**head_req, "messages": bare}, timeout_s)] if bare else []))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        if isinstance(exc, _NoRoute):
            timelines.no_render = str(exc)
        return Plan("chat", RENDER_FAILED, {"error": str(exc)[:300]})
    full_ids, head_ids = full["tokens"], head["tokens"]
    if bare_head:
        bare_ids = bare_head[0]["tokens"]
        # Dropped: now (the head renders the same without reasoning), or once later turns come (the whole
        # conversation follows the head without reasoning, not the head with it: Qwen3 at a new user message).
        dropped = bare_ids == head_ids or (full_ids[:len(head_ids)] != head_ids
                                           and full_ids[:len(bare_ids)] == bare_ids)
        if dropped and timelines.reasoning_history == AS_RENDERED:
            echoed = any(messages[reply_index].get(k) for k in ("reasoning", "reasoning_content"))
            return Plan("chat", DROPS_REASONING, {"parent_call": parent.call_id, "reply_message": reply_index,
                                                  "reasoning_sent": echoed})
        if dropped:  # keep: the sampled reasoning stays in context; what follows is cut after the bare head
            head_ids = bare_ids
    if full_ids[:len(head_ids)] != head_ids:
        at = next((k for k, (a, b) in enumerate(zip(full_ids, head_ids, strict=False)) if a != b), len(full_ids))
        return Plan("chat", NOT_APPEND_ONLY, {"position": at})
    sampled, rest = parent.completion_ids, full_ids[len(head_ids):]
    if turn_end:
        if head_ids[-len(turn_end):] != turn_end:
            return Plan("chat", CLOSE_TOKEN_NOT_RENDERED, {"turn_end": turn_end})
        close, glue = turn_end[0], turn_end[1:]
        synthetic = sampled[-1] != close  # cut off, or stopped on another stop token: close the turn as context
        prompt = [*parent.prompt_ids, *sampled, *([close] if synthetic else ()), *glue, *rest]
    elif rest and sampled[-1] == rest[0]:
        # The template closes no turn (GLM): a reply ends on the stop token that opens the next message, which is
        # where the render of what follows starts.
        synthetic, prompt = False, [*parent.prompt_ids, *sampled, *rest[1:]]
    else:
        return Plan("chat", CLOSE_TOKEN_NOT_RENDERED, {"turn_end": turn_end})
    max_len = full.get("max_model_len")
    if not isinstance(max_len, int):
        return Plan("chat", RENDER_FAILED, {"error": "/tokenize did not say the engine's max_model_len"})
    if len(prompt) >= max_len:
        return Plan("chat", PROMPT_TOO_LONG, {"prompt_tokens": len(prompt), "max_model_len": max_len})
    detail = {"parent_call": parent.call_id, "parent_choice": parent.choice_index, "reply_message": reply_index,
              "rendered_tokens": len(full_ids), "prompt_tokens": len(prompt)}
    if synthetic:
        detail["synthetic_close"] = True
    return Plan("token_exact", None, detail, prompt, max_len)


def _as_chat_renders(messages: list) -> list:
    """The messages as vLLM's chat endpoint hands them to the template: it reads a reply's reasoning from
    `reasoning`, taking the older `reasoning_content` as that; its /tokenize route does not rename it itself."""
    if not any(isinstance(m, dict) and "reasoning_content" in m for m in messages):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and "reasoning_content" in m:
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            if m.get("reasoning") is None and messages[len(out)].get("reasoning_content") is not None:
                m["reasoning"] = messages[len(out)]["reasoning_content"]
        out.append(m)
    return out


def _without_reasoning(message) -> dict:
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return message
    return {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}


async def _turn_end(timelines: Timelines, session: HttpClient, base_url: str, common: dict,
                    timeout_s: float) -> list[int]:
    """What the template puts after an assistant turn's content: [close token, *glue] (e.g. `<|im_end|>`, "\n").
    Found once per model and template arguments, as the common tail of two one-turn renders."""
    key = (common["model"], orjson.dumps(common.get("chat_template_kwargs"), option=orjson.OPT_SORT_KEYS))
    found = timelines.turn_ends.get(key)
    if found is not None:
        return found
    user = {"role": "user", "content": "x"}
    empty, short = await asyncio.gather(*(
        _tokenize(session, base_url, {**common, "tools": None, "messages": [user, {"role": "assistant", "content": c}],
                                      "add_generation_prompt": False}, timeout_s) for c in ("", "x")))
    # From where the two renders part (not from the generation prompt's end: it may hold more, e.g. Qwen3's empty
    # think block with enable_thinking off), their common tail is the turn end.
    start = 0
    while start < min(len(empty["tokens"]), len(short["tokens"])) and empty["tokens"][start] == short["tokens"][start]:
        start += 1
    a, b = empty["tokens"][start:], short["tokens"][start:]
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    found = timelines.turn_ends[key] = a[len(a) - n:] if n else []
    return found


async def _tokenize(session: HttpClient, base_url: str, req: dict, timeout_s: float) -> dict:
    req = {k: v for k, v in req.items() if v is not None}
    headers = {"Content-Type": "application/json"}
    async with asyncio.timeout(timeout_s), session.post(base_url + "/tokenize", data=orjson.dumps(req),
                                                         headers=headers) as resp:
        raw = await resp.read()
        if resp.status in (404, 405):
            raise _NoRoute(f"the engine has no /tokenize route (answered {resp.status}): every continued call is "
                           "rendered by its chat endpoint")
        if resp.status != 200:
            raise ValueError(f"/tokenize answered {resp.status}: {raw[:200].decode('utf-8', 'replace')}")
    out = orjson.loads(raw)
    if not isinstance(out, dict) or not isinstance(out.get("tokens"), list):
        raise ValueError(f"/tokenize answered without a token list: {raw[:200].decode('utf-8', 'replace')}")
    return out


class _NoRoute(ValueError):
    pass
