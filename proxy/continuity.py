"""Token-exact continuity: the next prompt of a conversation is built from the ids the engine really used.

An agent re-sends its whole conversation on every call. Rendered again by the chat template, an earlier assistant
turn can come back as other tokens than the engine sampled (re-serialised tool arguments, text that tokenizes
differently), so the calls no longer extend each other and training on the re-rendered text would train tokens
the model never produced. Here, when a chat request repeats an earlier call of the same episode plus that call's
reply, the prompt is built as

    parent prompt ids + parent completion ids (its close token included) + the template's rendering of the rest

where "the rest" is taken from the engine's own render of the whole conversation, after the close token that ends
the parent's reply (so the newline the template puts after a turn is context, not sampled). A reply that did not
end on the template's close token (cut off by max_tokens, or stopped by another stop token such as
`<|endoftext|>`) gets the close token appended as context: the sampled ids stay exactly as sampled, and the
record says so (`synthetic_close`). The call then goes to `/v1/completions` with those ids and the answer is
turned back into a chat completion (proxy/chat_answer.py).

Matching is by canonical messages (role, text, tool calls as name + parsed arguments with sorted keys; ids and
reasoning dropped) folded into rolling hashes, with the model name, tools and template arguments in the first
one. Anything else falls back to the engine's chat rendering, and the call records why (`Call.extra`).
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp
import orjson

from harness.core.records import Call

# Fallback reasons (Call.extra["continuity"]["reason"]).
NO_EARLIER_CALL = "no_earlier_call"  # nothing of this episode to continue (its first call, or forgotten)
HISTORY_NOT_RECORDED = "history_not_recorded"  # no earlier call + its reply is a prefix of these messages
NO_NEW_MESSAGES = "no_new_messages"  # the messages end with the earlier reply itself
PARENT_EMPTY = "parent_empty"  # the earlier reply has no sampled token at all
UNSUPPORTED = "unsupported_request"  # a request feature the completions path cannot reproduce (see detail)
RENDER_FAILED = "render_failed"  # the engine could not render the conversation (/tokenize failed)
NOT_APPEND_ONLY = "template_not_append_only"  # rendering the new messages changed the rendering before them
CLOSE_TOKEN_NOT_RENDERED = "close_token_not_rendered"  # the template's turn end was not found after the reply
PROMPT_TOO_LONG = "prompt_too_long"  # the spliced prompt leaves no room to generate

# Request fields that change how a conversation is rendered: part of the match key.
_TEMPLATE_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
# Request fields the completions path cannot honour: their presence falls back to chat rendering.
_UNSUPPORTED_FIELDS = ("response_format", "functions", "function_call", "chat_template", "documents", "echo",
                       "continue_final_message", "prompt_logprobs", "mm_processor_kwargs")
# Chat-only fields dropped from the completions request.
_CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs",
              "max_completion_tokens", "chat_template_kwargs", "add_generation_prompt", "reasoning_effort",
              "include_reasoning", "user", "store", "metadata", "service_tier", "modalities", "audio", "prediction",
              "web_search_options", "return_token_ids", "skip_special_tokens_in_tools")


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return h.digest()


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _arguments(arguments) -> bytes:
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments.encode()
    return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)


def _tool_calls(calls) -> list:
    out = []
    for call in calls or ():
        fn = call.get("function") or {} if isinstance(call, dict) else {}
        out.append([fn.get("name"), _arguments(fn.get("arguments")).decode()])
    return out


def canonical_message(message: dict) -> bytes:
    """What of a message the template renders: role, text, tool calls (parsed), and which call a result answers."""
    return orjson.dumps([message.get("role"), _text(message.get("content")), _tool_calls(message.get("tool_calls")),
                         message.get("tool_call_id"), message.get("name")])


def canonical_reply(content, tool_calls) -> bytes:
    """An assistant reply as the agent received it or echoes it back: text and parsed tool calls, no ids."""
    return orjson.dumps(["assistant", _text(content), _tool_calls(tool_calls)])


def prefix_hashes(body: dict) -> list[bytes]:
    """h[i] identifies (model, template fields, messages[:i]); len(h) == len(messages) + 1."""
    key = orjson.dumps([body.get("model"), *(body.get(f) for f in _TEMPLATE_FIELDS)], option=orjson.OPT_SORT_KEYS)
    hashes = [_digest(key)]
    for message in body["messages"]:
        hashes.append(_digest(hashes[-1], canonical_message(message)))
    return hashes


def _extension_key(prefix_hash: bytes, reply: bytes) -> bytes:
    return _digest(prefix_hash, b"reply", reply)


@dataclass
class Parent:
    """One choice of an earlier call: the timeline a new request may continue."""

    call_id: str
    choice_index: int
    prompt_ids: array
    completion_ids: array
    unusable: str | None  # why it cannot be continued token-exactly, or None

    @property
    def size(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class _EpisodeTimelines:
    parents: dict[bytes, Parent] = field(default_factory=dict)  # extension key -> parent, oldest first
    seen_prefixes: set[bytes] = field(default_factory=set)  # prefix hashes of requests recorded
    tokens: int = 0  # ids held by its parents (a prompt shared by n choices counts n times)


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


class Timelines:
    """Per episode, the earlier calls' replies that a later request may continue. Bounded: an episode keeps its
    `max_parents` latest replies, and least recently used episodes are forgotten first when there are more than
    `max_episodes` or their ids exceed `max_tokens` (their later calls then fall back to chat rendering, with a
    reason). The default budget, 32M ids, is 128 MB of int32."""

    def __init__(self, max_episodes: int = 4096, max_tokens: int = 32_000_000, max_parents: int = 64):
        self.max_episodes, self.max_tokens, self.max_parents = max_episodes, max_tokens, max_parents
        self.tokens = 0
        self._episodes: OrderedDict[str, _EpisodeTimelines] = OrderedDict()
        self.turn_ends: dict[tuple, list[int]] = {}  # (model, template kwargs) -> [close token, *glue]
        self.no_render: str | None = None  # set when the engine has no /tokenize: not asked again

    def _episode(self, episode_id: str, create: bool) -> _EpisodeTimelines | None:
        ep = self._episodes.get(episode_id)
        if ep is not None:
            self._episodes.move_to_end(episode_id)
        elif create:
            ep = self._episodes[episode_id] = _EpisodeTimelines()
            self._evict()
        return ep

    def _evict(self) -> None:
        while len(self._episodes) > 1 and (len(self._episodes) > self.max_episodes or self.tokens > self.max_tokens):
            _, ep = self._episodes.popitem(last=False)
            self.tokens -= ep.tokens

    def remember(self, call: Call, body: dict, hashes: list[bytes]) -> None:
        """After an answered chat call: each of its choices becomes a parent for the episode's next requests."""
        if call.prompt_ids is None:
            return
        ep = self._episode(call.episode_id, create=True)
        ep.seen_prefixes.update(hashes)
        prompt = array("i", call.prompt_ids)
        for choice in call.choices:
            if choice.completion_ids is None:
                continue
            unusable = None if choice.completion_ids else PARENT_EMPTY
            key = _extension_key(hashes[-1], canonical_reply(choice.text, choice.tool_calls))
            parent = Parent(call.call_id, choice.index, prompt, array("i", choice.completion_ids), unusable)
            self._drop(ep, ep.parents.pop(key, None))
            ep.parents[key] = parent
            ep.tokens += parent.size
            self.tokens += parent.size
            if len(ep.parents) > self.max_parents:
                self._drop(ep, ep.parents.pop(next(iter(ep.parents))))
        self._evict()

    def _drop(self, ep: _EpisodeTimelines, parent: Parent | None) -> None:
        if parent is not None:
            ep.tokens -= parent.size
            self.tokens -= parent.size

    def find(self, episode_id: str, body: dict, hashes: list[bytes]) -> tuple[Parent | None, int, Plan | None]:
        """The parent whose request + reply is the longest prefix of these messages, and the reply's index; or a
        fallback Plan saying why there is none."""
        ep = self._episode(episode_id, create=False)
        if ep is None or not ep.parents:
            return None, -1, Plan("chat", NO_EARLIER_CALL)
        messages = body["messages"]
        for i in range(len(messages) - 1, -1, -1):
            message = messages[i]
            if message.get("role") != "assistant":
                continue
            parent = ep.parents.get(_extension_key(hashes[i], canonical_reply(message.get("content"),
                                                                                message.get("tool_calls"))))
            if parent is None:
                continue
            if parent.unusable:
                return None, i, Plan("chat", parent.unusable, {"parent_call": parent.call_id})
            if i == len(messages) - 1:
                return None, i, Plan("chat", NO_NEW_MESSAGES, {"parent_call": parent.call_id})
            return parent, i, None
        matched = max((i for i, h in enumerate(hashes) if h in ep.seen_prefixes), default=0)
        return None, -1, Plan("chat", HISTORY_NOT_RECORDED, {"first_unmatched_message": matched})


def unsupported(body: dict) -> str | None:
    """The first request feature that token-exact serving cannot reproduce, or None."""
    for key in _UNSUPPORTED_FIELDS:
        if body.get(key) not in (None, False):
            return key
    if body.get("add_generation_prompt") is False:
        return "add_generation_prompt"
    if body.get("tool_choice") not in (None, "auto", "none"):
        return "tool_choice"
    return None


async def splice(timelines: Timelines, session: aiohttp.ClientSession, base_url: str, body: dict, parent: Parent,
                 reply_index: int, timeout_s: float = 30.0) -> Plan:
    """Build the prompt ids: the parent's recorded ids, then the engine's render of everything after the parent's
    reply (from /tokenize, which renders exactly as the engine's chat endpoint does)."""
    messages = body["messages"]
    common = {"model": body.get("model"), "tools": body.get("tools"),
              "chat_template_kwargs": body.get("chat_template_kwargs")}
    full_req = {**common, "messages": messages, "add_generation_prompt": True}
    head_req = {**common, "messages": messages[:reply_index + 1], "add_generation_prompt": False}
    try:
        full, head, turn_end = await asyncio.gather(
            _tokenize(session, base_url, full_req, timeout_s), _tokenize(session, base_url, head_req, timeout_s),
            _turn_end(timelines, session, base_url, common, timeout_s))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        if isinstance(exc, _NoRoute):
            timelines.no_render = str(exc)
        return Plan("chat", RENDER_FAILED, {"error": str(exc)[:300]})
    full_ids, head_ids = full["tokens"], head["tokens"]
    if full_ids[:len(head_ids)] != head_ids:
        at = next((k for k, (a, b) in enumerate(zip(full_ids, head_ids, strict=False)) if a != b), len(full_ids))
        return Plan("chat", NOT_APPEND_ONLY, {"position": at})
    if not turn_end or head_ids[-len(turn_end):] != turn_end:
        return Plan("chat", CLOSE_TOKEN_NOT_RENDERED, {"turn_end": turn_end})
    close, glue = turn_end[0], turn_end[1:]
    sampled = parent.completion_ids
    synthetic = sampled[-1] != close  # cut off, or stopped on another stop token: close the turn as context
    prompt = [*parent.prompt_ids, *sampled, *([close] if synthetic else ()), *glue, *full_ids[len(head_ids):]]
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


async def _turn_end(timelines: Timelines, session: aiohttp.ClientSession, base_url: str, common: dict,
                    timeout_s: float) -> list[int]:
    """What the template puts after an assistant turn's content: [close token, *glue] (e.g. `<|im_end|>`, "\n").
    Found once per model and template arguments, as the common tail of two one-turn renders."""
    key = (common["model"], orjson.dumps(common.get("chat_template_kwargs"), option=orjson.OPT_SORT_KEYS))
    found = timelines.turn_ends.get(key)
    if found is not None:
        return found
    user = {"role": "user", "content": "x"}
    asked, empty, short = await asyncio.gather(*(
        _tokenize(session, base_url, {**common, "tools": None, "messages": m, "add_generation_prompt": gen}, timeout_s)
        for m, gen in (([user], True), ([user, {"role": "assistant", "content": ""}], False),
                       ([user, {"role": "assistant", "content": "x"}], False))))
    start = len(asked["tokens"])
    a, b = empty["tokens"][start:], short["tokens"][start:]
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    found = timelines.turn_ends[key] = a[len(a) - n:] if n else []
    return found


async def _tokenize(session: aiohttp.ClientSession, base_url: str, req: dict, timeout_s: float) -> dict:
    req = {k: v for k, v in req.items() if v is not None}
    headers = {"Content-Type": "application/json"}
    async with session.post(base_url + "/tokenize", data=orjson.dumps(req), headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
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


def completions_body(body: dict, plan: Plan) -> dict:
    """The chat request (already prepared for the engine) as a /v1/completions request on the spliced ids."""
    out = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    out["prompt"] = plan.prompt_ids
    out["add_special_tokens"] = False
    out["return_token_ids"] = True
    out["logprobs"] = int(body.get("top_logprobs") or 0)
    if body.get("tools") and body.get("tool_choice") != "none":
        out["skip_special_tokens"] = False  # as vLLM's chat endpoint does for tool parsing: markers may be special
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    # Always explicit (the completions default is 16); unasked, the chat endpoint's default: all the room left.
    out["max_tokens"] = max_tokens if max_tokens is not None else plan.max_model_len - len(plan.prompt_ids)
    return out


async def plan(timelines: Timelines, episode_id: str, body: dict, hashes: list[bytes],
               session: aiohttp.ClientSession, base_url: str) -> Plan:
    """Decide how to serve one chat request: token-exact when it continues a recorded reply, else chat rendering."""
    parent, reply_index, fallback = timelines.find(episode_id, body, hashes)
    if fallback is not None:
        return fallback
    feature = unsupported(body)
    if feature is not None:
        return Plan("chat", UNSUPPORTED, {"field": feature, "parent_call": parent.call_id})
    if timelines.no_render is not None:
        return Plan("chat", RENDER_FAILED, {"error": timelines.no_render})
    return await splice(timelines, session, base_url, body, parent, reply_index)
