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
record says so (`synthetic_close`). proxy/splice.py builds that prompt. The call then goes to `/v1/completions`
with those ids and the answer is turned back into a chat completion (proxy/chat_answer.py).

Matching is by canonical messages (role, text, tool calls as name + parsed arguments with sorted keys; ids and
reasoning dropped) folded into rolling hashes, with the model name, tools and template arguments in the first
one. Assistant messages count by their words (whitespace runs and ends ignored): many agents strip or collapse
the whitespace of the replies they keep, or re-serialise tool arguments, and the model should go on from the ids
it sampled, not from the tidied text; the call records which replies came back tidied (`normalised`). Other
messages count exactly as sent: a user, system or tool message whose whitespace changed is another context. A
reply whose words changed is the agent's edit (`edited`, with where), which the merger then reports as
`reply_edited` rather than as retokenization drift. Anything that cannot be continued falls back to the engine's
chat rendering, and the call records why (`Call.extra`).
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import orjson

from harness.core.records import Call
from proxy.engine_client import HttpClient
from proxy.parsing.native import RequestParsing
from proxy.splice import AS_RENDERED, REASONING_HISTORY, RENDER_FAILED, Plan, splice

# Fallback reasons (Call.extra["continuity"]["reason"]).
NO_EARLIER_CALL = "no_earlier_call"  # nothing of this episode to continue (its first call, or forgotten)
HISTORY_NOT_RECORDED = "history_not_recorded"  # no earlier call + its reply is a prefix of these messages
RESEND = "resend"  # the same messages as an earlier call of the episode (a retry of a reply cut off or lost)
REPLY_EDITED = "reply_edited"  # the history follows an earlier call up to a reply whose words the agent changed
NO_NEW_MESSAGES = "no_new_messages"  # the messages end with the earlier reply itself
PARENT_EMPTY = "parent_empty"  # the earlier reply has no sampled token at all
UNSUPPORTED = "unsupported_request"  # a request feature the completions path cannot reproduce (see detail)
# The splice's own (proxy/splice.py): RENDER_FAILED, NOT_APPEND_ONLY, CLOSE_TOKEN_NOT_RENDERED, PROMPT_TOO_LONG,
# and DROPS_REASONING, which follows its `reasoning_history` choices (AS_RENDERED, KEEP).

# What an agent may change in a reply it re-sends and still continue it (Call.extra["continuity"]["normalised"]).
WHITESPACE = "whitespace"  # the same words, other whitespace between, before or after them
TOOL_ARGUMENTS = "tool_arguments"  # the same parsed arguments, serialised otherwise (spacing, key order)

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


def _words(text: str) -> str:
    return " ".join(text.split())


def canonical_message(message: dict) -> bytes:
    """What of a message the template renders: role, text, tool calls (parsed), and which call a result answers.
    An assistant message's text counts by its words: agents tidy the whitespace of the replies they keep, and the
    model should go on from what it wrote (its ids), not from the tidied text. Other messages count as sent."""
    text = _text(message.get("content"))
    role = message.get("role")
    return orjson.dumps([role, _words(text) if role == "assistant" else text, _tool_calls(message.get("tool_calls")),
                         message.get("tool_call_id"), message.get("name")])


def canonical_reply(content, tool_calls) -> bytes:
    """An assistant reply as the agent received it or echoes it back, tidied or not: its words (whitespace runs
    and ends ignored) and parsed tool calls, no ids. Two replies with the same canonical form continue alike."""
    return orjson.dumps(["assistant", _words(_text(content)), _tool_calls(tool_calls)])


def prefix_hashes(body: dict) -> list[bytes]:
    """h[i] identifies (model, template fields, messages[:i]) as canonical_message sees them (assistant messages
    by their words); len(h) == len(messages) + 1."""
    key = orjson.dumps([body.get("model"), *(body.get(f) for f in _TEMPLATE_FIELDS)], option=orjson.OPT_SORT_KEYS)
    hashes = [_digest(key)]
    for message in body["messages"]:
        hashes.append(_digest(hashes[-1], canonical_message(message)))
    return hashes


def _extension_key(prefix_hash: bytes, reply: bytes) -> bytes:
    return _digest(prefix_hash, b"reply", reply)


_WORD = re.compile(r"\S+")


def first_edit(sent: str, sampled: str) -> int | None:
    """Where `sent` first differs from `sampled` other than by whitespace, as an offset into `sent`; None when
    only whitespace differs. A truncated text differs where it ends (after its last word)."""
    words = [(m.start(), m.group()) for m in _WORD.finditer(sent)]
    theirs = _WORD.findall(sampled)
    for (start, word), other in zip(words, theirs, strict=False):
        if word != other:
            common = next((k for k, (a, b) in enumerate(zip(word, other, strict=False)) if a != b),
                          min(len(word), len(other)))
            return start + common
    if len(words) > len(theirs):
        return words[len(theirs)][0]
    if len(words) < len(theirs):
        return words[-1][0] + len(words[-1][1]) if words else 0
    return None


@dataclass
class Parent:
    """One choice of an earlier call: the timeline a new request may continue."""

    call_id: str
    choice_index: int
    prompt_ids: array
    completion_ids: array
    unusable: str | None  # why it cannot be continued token-exactly, or None
    prefix: bytes  # the prefix hash of the request it answered
    text: str  # the reply's text as the agent received it ("" for none)
    tool_calls: list | None  # its tool calls as the agent received them
    reasoned: bool = False  # the engine split reasoning out of the reply (it is in completion_ids, not in text)

    @property
    def size(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def normalised(self, message: dict) -> list[str]:
        """How an echo of this reply (same canonical form) differs from what the agent received: [] if not at all."""
        kinds = []
        if _text(message.get("content")) != self.text:
            kinds.append(WHITESPACE)
        if _raw_arguments(message.get("tool_calls")) != _raw_arguments(self.tool_calls):
            kinds.append(TOOL_ARGUMENTS)
        return kinds


def _raw_arguments(calls) -> list:
    return [(c.get("function") or {}).get("arguments") if isinstance(c, dict) else c for c in calls or ()]


@dataclass
class _EpisodeTimelines:
    parents: dict[bytes, Parent] = field(default_factory=dict)  # extension key -> parent, oldest first
    answered: dict[bytes, list[Parent]] = field(default_factory=dict)  # request's prefix hash -> its parents
    seen_prefixes: set[bytes] = field(default_factory=set)  # prefix hashes of requests recorded
    prompts: dict[bytes, str] = field(default_factory=dict)  # a request's whole prefix hash -> its latest call_id
    tokens: int = 0  # ids held by its parents (a prompt shared by n choices counts n times)


@dataclass
class Found:
    """The reply a request continues and its index (or the fallback saying why there is none), and notes for the
    call's record whatever serves it: `normalised` (tidied replies), `edited` (a reply the agent changed)."""

    parent: Parent | None = None
    reply_index: int = -1
    fallback: Plan | None = None
    notes: dict = field(default_factory=dict)


class Timelines:
    """Per episode, the earlier calls' replies that a later request may continue. Bounded: an episode keeps its
    `max_parents` latest replies, and least recently used episodes are forgotten first when there are more than
    `max_episodes` or their ids exceed `max_tokens` (their later calls then fall back to chat rendering, with a
    reason). The default budget, 32M ids, is 128 MB of int32 (a reply's text, kept to tell a tidied echo from an
    edited one, is small next to the prompt ids)."""

    def __init__(self, max_episodes: int = 4096, max_tokens: int = 32_000_000, max_parents: int = 64,
                 reasoning_history: str = AS_RENDERED, max_seen_prefixes: int = 16_384):
        if reasoning_history not in REASONING_HISTORY:
            raise ValueError(f"reasoning_history {reasoning_history!r}: use one of {', '.join(REASONING_HISTORY)}")
        self.max_episodes, self.max_tokens, self.max_parents = max_episodes, max_tokens, max_parents
        # An episode's request prefixes seen, for a fallback's `first_unmatched_message`; started afresh past this
        # many (the default episode takes every call that names none, for as long as the proxy runs).
        self.max_seen_prefixes = max_seen_prefixes
        self.reasoning_history = reasoning_history
        self.forced_tools = False  # forced tool calls can be served token-exactly (set from the reply parsing)
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
        if len(ep.seen_prefixes) >= self.max_seen_prefixes:
            ep.seen_prefixes.clear()
            ep.prompts.clear()
        ep.seen_prefixes.update(hashes)
        ep.prompts[hashes[-1]] = call.call_id
        prefix = hashes[-1]
        prompt = array("i", call.prompt_ids)
        for choice in call.choices:
            if choice.completion_ids is None:
                continue
            unusable = None if choice.completion_ids else PARENT_EMPTY
            key = _extension_key(prefix, canonical_reply(choice.text, choice.tool_calls))
            parent = Parent(call.call_id, choice.index, prompt, array("i", choice.completion_ids), unusable, prefix,
                            _text(choice.text), choice.tool_calls, bool(choice.reasoning))
            self._drop(ep, ep.parents.pop(key, None))
            ep.parents[key] = parent
            ep.answered.setdefault(prefix, []).append(parent)
            ep.tokens += parent.size
            self.tokens += parent.size
            if len(ep.parents) > self.max_parents:
                self._drop(ep, ep.parents.pop(next(iter(ep.parents))))
        self._evict()

    def _drop(self, ep: _EpisodeTimelines, parent: Parent | None) -> None:
        if parent is not None:
            ep.tokens -= parent.size
            self.tokens -= parent.size
            replies = ep.answered[parent.prefix]
            replies.remove(parent)
            if not replies:
                del ep.answered[parent.prefix]

    def find(self, episode_id: str, body: dict, hashes: list[bytes]) -> Found:
        """The parent whose request + reply is the longest prefix of these messages, and the reply's index; or a
        fallback Plan saying why there is none. Notes which remembered replies came back tidied, and a later
        assistant message that answers a remembered request but is none of its replies (the agent edited it)."""
        ep = self._episode(episode_id, create=False)
        if ep is None or not ep.parents:
            return Found(fallback=_resend(ep, hashes) or Plan("chat", NO_EARLIER_CALL))
        messages = body["messages"]
        parent, i, edited_at = None, len(messages), -1
        while parent is None and i > 0:
            i -= 1
            message = messages[i]
            if message.get("role") != "assistant":
                continue
            parent = ep.parents.get(_extension_key(hashes[i], canonical_reply(message.get("content"),
                                                                                message.get("tool_calls"))))
            if parent is None and edited_at < 0 and hashes[i] in ep.answered:
                edited_at = i
        notes = {}
        if edited_at >= 0:
            notes["edited"] = _edit(ep.answered[hashes[edited_at]], messages[edited_at], edited_at)
        if parent is None:
            if notes:
                return Found(fallback=Plan("chat", REPLY_EDITED), notes=notes)
            if (resent := _resend(ep, hashes)) is not None:
                return Found(fallback=resent)
            matched = max((k for k, h in enumerate(hashes) if h in ep.seen_prefixes), default=0)
            return Found(fallback=Plan("chat", HISTORY_NOT_RECORDED, {"first_unmatched_message": matched}))
        replies = [*self._replies(ep, messages[:i], hashes), (i, parent)]
        normalised = [{"message": j, "kind": kind} for j, p in replies for kind in p.normalised(messages[j])]
        if normalised:
            notes["normalised"] = normalised
        if parent.unusable:
            return Found(fallback=Plan("chat", parent.unusable, {"parent_call": parent.call_id}), notes=notes)
        if i == len(messages) - 1:
            return Found(fallback=Plan("chat", NO_NEW_MESSAGES, {"parent_call": parent.call_id}), notes=notes)
        return Found(parent, i, notes=notes)

    @staticmethod
    def _replies(ep: _EpisodeTimelines, messages: list[dict], hashes: list[bytes]):
        """(index, parent) of each of these assistant messages that is a reply the episode still remembers."""
        for j, message in enumerate(messages):
            if message.get("role") == "assistant":
                key = _extension_key(hashes[j], canonical_reply(message.get("content"), message.get("tool_calls")))
                if (parent := ep.parents.get(key)) is not None:
                    yield j, parent


def _resend(ep: _EpisodeTimelines | None, hashes: list[bytes]) -> Plan | None:
    """RESEND when these messages are exactly an earlier request's of the episode (model, tools and template fields
    too): an agent retrying a call, e.g. Qwen Code after a reply cut off. Not a history the proxy failed to keep."""
    earlier = ep.prompts.get(hashes[-1]) if ep is not None else None
    return Plan("chat", RESEND, {"earlier_call": earlier}) if earlier is not None else None


def _edit(replies: list[Parent], message: dict, index: int) -> dict:
    """Where an assistant message differs from the closest of the replies its request was answered with: the
    first character of its text, or (same words) the first tool call that differs."""
    text, calls = _text(message.get("content")), _tool_calls(message.get("tool_calls"))
    best, best_key = {}, None
    for parent in replies:
        at = first_edit(text, parent.text)
        if at is None:
            theirs = _tool_calls(parent.tool_calls)
            at = next((k for k, (a, b) in enumerate(zip(calls, theirs, strict=False)) if a != b),
                      min(len(calls), len(theirs)))
            where, key = {"tool_call": at}, (1, at)
        else:
            where, key = {"char": at}, (0, at)
        if best_key is None or key >= best_key:  # of equally close replies, the latest
            best, best_key = {"message": index, **where, "parent_call": parent.call_id}, key
    return best


def unsupported(body: dict, forced_tools: bool = False) -> str | None:
    """The first request feature that token-exact serving cannot reproduce, or None. `forced_tools`: the proxy
    parses with vLLM's own parsers, which also give the constraint the chat endpoint puts on a forced tool call
    (`tool_choice` "required" or a named function), so those are served token-exactly too."""
    for key in _UNSUPPORTED_FIELDS:
        if body.get(key) not in (None, False):
            return key
    if body.get("add_generation_prompt") is False:
        return "add_generation_prompt"
    if body.get("tool_choice") not in (None, "auto", "none") and not forced_tools:
        return "tool_choice"
    return None


def completions_body(body: dict, plan: Plan, parsing: RequestParsing) -> dict:
    """The chat request (already prepared for the engine) as a /v1/completions request on the spliced ids."""
    out = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    out["prompt"] = plan.prompt_ids
    out["add_special_tokens"] = False
    out["return_token_ids"] = True
    out["logprobs"] = int(body.get("top_logprobs") or 0)
    if not parsing.skip_special_tokens:  # as vLLM's chat endpoint decodes for its parsers: markers may be special
        out["skip_special_tokens"] = False
    if parsing.structured_outputs is not None:  # a constraint the chat endpoint's tool parser puts on generation
        out["structured_outputs"] = parsing.structured_outputs
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    # Always explicit (the completions default is 16); unasked, the chat endpoint's default: all the room left.
    out["max_tokens"] = max_tokens if max_tokens is not None else plan.max_model_len - len(plan.prompt_ids)
    return out


async def plan(timelines: Timelines, episode_id: str, body: dict, hashes: list[bytes],
               session: HttpClient, base_url: str) -> Plan:
    """Decide how to serve one chat request: token-exact when it continues a recorded reply, else chat rendering."""
    found = timelines.find(episode_id, body, hashes)
    parent = found.parent
    if found.fallback is not None:
        how = found.fallback
    elif (feature := unsupported(body, timelines.forced_tools)) is not None:
        how = Plan("chat", UNSUPPORTED, {"field": feature, "parent_call": parent.call_id})
    elif timelines.no_render is not None:
        how = Plan("chat", RENDER_FAILED, {"error": timelines.no_render})
    else:
        how = await splice(timelines, session, base_url, body, parent, found.reply_index)
    how.detail.update(found.notes)
    return how
