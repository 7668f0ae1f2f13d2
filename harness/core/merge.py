"""From recorded calls to training sequences: calls that extend each other merge into one timeline.

A call extends an earlier node (an earlier call's choice) of the same role when its prompt ids start with that
node's prompt ids + completion ids. The nodes form a prefix tree per role; every leaf is exported as one Sample
whose mask marks exactly the engine-sampled tokens (completion ids, mask 1, with their logprobs) and nothing
else (prompts, tool results, template text between turns: mask 0). Pure functions over records; no I/O.

Every call that does not continue the closest earlier timeline says why (`Break`): the first call of the
episode or of a role, a changed system prompt or tool list, a history that was cut or summarised,
retokenization drift (the earlier assistant turn came back as different tokens), or an earlier reply the agent
edited, with the first differing position and the tokens on both sides. The merger sees only ids, so the last two
look alike to it: a call whose record says the proxy found an edited reply in its history (proxy/continuity.py,
`calls.extra.continuity.edited`) is `reply_edited`, and drift keeps meaning "the same text came back as other
tokens". A drifted or edited call may still extend an ancestor of that timeline: it then merges there, the
drifted reply is context (mask 0) and its Break says so. A call with n>1 choices is one
branch point: its first choice carries the call's reason (or none), every other choice is an N_BRANCH sibling;
a call that sends an earlier call's prompt again (a retry, a regenerate) is an N_BRANCH sibling of that call.

Sub-agents (Codex's spawn_agent, Claude Code's Agent tool, any agent that hands a task to another conversation):
a call that starts a new timeline, whose user messages carry a string argument (24 characters or more) of a tool
call an earlier call of the episode made, is SUB_AGENT, and its Break names that call and tool call (the
latest one that matches). Its timeline merges apart, like any other, and is trained with the episode's reward.

Compaction (Claude Code and Codex on long tasks, any agent that summarises its context): the summary is an earlier
call's reply, and the conversation goes on from a history that starts from it. A call that starts a new timeline
(and is no sub-agent), whose user messages carry a passage (80 characters or more, between markup tags and blank
lines, spaces collapsed) of the reply of an earlier answered call of the same model name (and named role, where
roles are named; the system prompt and tools may change, as Claude Code's do), is COMPACTION, and its Break names
that call: the summary call, whose prompt was the
history it summarised. The summary call itself continues that history (its timeline ends with the summary); the
continued timeline merges apart and is trained with the episode's reward, like a sub-agent's.

Cost: each role keeps its nodes longest first, so finding the parent stops at the first node that is a prefix
of the prompt: one comparison of the prompt per call for an append-only agent, whatever the episode's length.
"""

from __future__ import annotations

import re
from bisect import bisect
from dataclasses import dataclass, field, replace

import orjson

from harness.core.flags import cuts
from harness.core.records import ENGINE, OK, Break, Call, Sample

__all__ = ["COMPACTION", "DROPS_REASONING", "DRIFT", "FIRST_CALL", "HISTORY_CHANGED", "MERGE_VERSION", "N_BRANCH",
           "NEW_ROLE", "REASONS", "REPLY_EDITED", "SUB_AGENT", "SYSTEM_CHANGED", "TOOLS_CHANGED", "Merged",
           "format_merge_summary", "merge_episode", "mergeable", "reply_edited", "summarise_merges"]  # fmt: skip

# Stored with every sample: bump it when merge_episode would build other samples from the same calls.
# 2: a drift break of a call whose history holds an edited reply is reply_edited.
# 3: a drift break of a call the proxy served on a history whose template dropped a reply's reasoning is
#    template_drops_reasoning.
# 4: a new timeline an earlier tool call handed its task to is sub_agent, with its parent call and tool call.
# 5: a new timeline that goes on from an earlier reply (a summary of the history) is compaction, with that call.
MERGE_VERSION = 5

# Break.reason values.
FIRST_CALL = "first_call"  # the episode's first call
NEW_ROLE = "new_role"  # the first call of this role (another model name) in the episode
SYSTEM_CHANGED = "system_prompt_changed"  # same model name, another system prompt than the role before it
TOOLS_CHANGED = "tools_changed"  # same model name and system prompt, another tool list
HISTORY_CHANGED = "history_changed"  # the shared history differs before the last assistant turn (cut, summarised)
DRIFT = "retokenization_drift"  # the history matches up to an assistant turn, whose tokens came back different
REPLY_EDITED = "reply_edited"  # as DRIFT, but the agent changed that turn's text (the call's record says where)
DROPS_REASONING = "template_drops_reasoning"  # as DRIFT, but the template left that turn's reasoning out
SUB_AGENT = "sub_agent"  # a new timeline whose user messages carry an earlier tool call's argument (a task)
COMPACTION = "compaction"  # a new timeline whose user messages carry an earlier call's reply (its history's summary)
N_BRANCH = "n_branch"  # a sibling on the same prompt: choice 1.. of an n>1 call, or a call repeating a prompt
REASONS = (FIRST_CALL, NEW_ROLE, SYSTEM_CHANGED, TOOLS_CHANGED, HISTORY_CHANGED, DRIFT, REPLY_EDITED, DROPS_REASONING,
           SUB_AGENT, COMPACTION, N_BRANCH)

_SHOWN = 8  # tokens of each side a Break keeps
_NEW_TIMELINE = (NEW_ROLE, SYSTEM_CHANGED, TOOLS_CHANGED, HISTORY_CHANGED)  # what a sub-agent's first call looks like
_TASK_CHARS = 24  # a tool call's string argument this long or longer can be a sub-agent's task
_SUMMARY_CHARS = 80  # an earlier reply this long or longer, found in a new timeline's user messages, is its summary
_SPACE = re.compile(r"\s+")
_PASSAGE_BREAK = re.compile(r"<[^<>\n]{1,40}>|\n\s*\n")  # a markup tag or a blank line


@dataclass(eq=False, slots=True)
class _Node:
    call: Call
    choice_index: int
    completion_ids: list[int]
    logprobs: list[float]
    order: int  # creation order within the role: of two equally good nodes, the earlier one wins
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)
    prompt_len: int = field(init=False)
    seq_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.call.prompt_ids)
        self.seq_len = self.prompt_len + len(self.completion_ids)

    def seq(self) -> list[int]:
        return self.call.prompt_ids + self.completion_ids


class _Role:
    """One role's nodes, longest sequence first (the earlier node first among equal lengths)."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self._keys: list[tuple[int, int]] = []

    def add(self, node: _Node) -> None:
        key = (-node.seq_len, node.order)
        i = bisect(self._keys, key)
        self._keys.insert(i, key)
        self.nodes.insert(i, node)


@dataclass
class Merged:
    """One episode merged: its samples, why each new timeline started, and the counts merge metrics need."""

    samples: list[Sample]
    breaks: list[Break]
    per_call_tokens: int  # tokens if every call's choice were its own sample
    merged_tokens: int  # tokens of the merged samples
    n_calls: int  # calls merged: answered, with the engine's token ids (see mergeable)
    n_followups: int  # calls with an earlier call of their role to continue: the denominator of the drift rate

    @property
    def merge_ratio(self) -> float:
        return self.per_call_tokens / self.merged_tokens if self.merged_tokens else 1.0

    @property
    def n_drift(self) -> int:
        """Calls whose prompt re-tokenized an earlier reply (one DRIFT break per call: its first choice's)."""
        return sum(b.reason == DRIFT for b in self.breaks)


def reply_edited(call: Call) -> bool:
    """Whether the proxy found, in this call's history, an earlier reply whose words the agent changed
    (`calls.extra.continuity.edited`: which message, and its first differing character or tool call)."""
    continuity = call.extra.get("continuity")
    return isinstance(continuity, dict) and continuity.get("edited") is not None


def _served(call: Call) -> str | None:
    """Why the proxy served this call by chat rendering (`calls.extra.continuity.reason`), if it says."""
    continuity = call.extra.get("continuity")
    return continuity.get("reason") if isinstance(continuity, dict) else None


def mergeable(call: Call, sources: tuple[str, ...] = (ENGINE,)) -> bool:
    """Calls that can be trained on: answered, with ids from one of `sources` (by default the engine's own)."""
    return call.status == OK and call.token_source in sources and call.prompt_ids is not None


def merge_episode(calls: list[Call], sources: tuple[str, ...] = (ENGINE,)) -> Merged:
    """Merge one episode's calls (any order; call_index decides) into samples, with a Break per new timeline.

    `sources`: the calls.token_source values merged. Only the engine's own ids by default; training on ids a
    tokenizer made after the fact (`retokenized`) is an explicit choice of the caller (offline.allow_retokenized)."""
    flags = {c.call_id: cuts(c) for c in calls}  # what cut each call short (harness/core/flags.py)
    whole = sorted({f["reason"] for fs in flags.values() for f in fs if f["choice"] is None})  # the whole episode
    answered = sorted((c for c in calls if c.status == OK), key=lambda c: c.call_index)  # who may spawn a sub-agent
    tasks: dict[str, list[tuple[str | None, list[str]]]] = {}  # call_id -> its tool calls' (id, task strings)
    calls = sorted((c for c in calls if mergeable(c, sources)), key=lambda c: c.call_index)
    roles: dict[str, _Role] = {}
    breaks: list[Break] = []
    roots: list[_Node] = []
    previous: Call | None = None
    followups = 0
    for call in calls:
        role = roles.setdefault(call.role_key, _Role())
        followups += bool(role.nodes)
        parent, why = _best_parent(call, role.nodes, previous)
        if why is not None and why.reason == DRIFT and reply_edited(call):
            why = replace(why, reason=REPLY_EDITED)  # the tokens differ because the text does
        elif why is not None and why.reason == DRIFT and _served(call) == DROPS_REASONING:
            why = replace(why, reason=DROPS_REASONING)  # the tokens differ because the reasoning is gone
        elif parent is None and why is not None and why.reason in _NEW_TIMELINE:
            why = _sub_agent(call, answered, tasks) or _compaction(call, answered) or why
        first = True
        for choice in call.choices:
            if choice.completion_ids is None:
                continue
            logprobs = list(choice.logprobs) if choice.logprobs is not None else [0.0] * len(choice.completion_ids)
            node = _Node(call, choice.index, list(choice.completion_ids), logprobs, len(role.nodes), parent)
            if parent is None:
                roots.append(node)
            else:
                parent.children.append(node)
            if not first:
                breaks.append(Break(call.call_id, choice.index, N_BRANCH))
            elif why is not None:
                breaks.append(replace(why, choice_index=choice.index))
            first = False
            role.add(node)
        previous = call
    cut_at = {(c.call_id, f["choice"]): f["reason"] for c in calls for f in flags[c.call_id] if f["choice"] is not None}
    samples = [_sample(leaf, whole, cut_at) for root in roots for leaf in _leaves(root)]
    per_call = sum(len(c.prompt_ids) + len(ch.completion_ids) for c in calls for ch in c.choices
                   if ch.completion_ids is not None)
    return Merged(samples, breaks, per_call, sum(len(s.token_ids) for s in samples), len(calls), followups)


def _best_parent(call: Call, earlier: list[_Node], previous: Call | None) -> tuple[_Node | None, Break | None]:
    """The deepest earlier node whose prompt + completion is a prefix of this call's prompt, and a Break when the
    call does not continue the closest earlier timeline. `earlier` is longest first."""
    prompt = call.prompt_ids
    n = len(prompt)
    best: _Node | None = None
    resampled = False  # an earlier call had exactly this prompt: this call samples it again (a retry)
    drifted: list[tuple[int, _Node]] = []  # (tokens shared with the prompt, node) for nodes whose prompt it repeats
    for node in earlier:
        p, end = node.prompt_len, node.seq_len
        if p > n or prompt[:p] != node.call.prompt_ids:
            continue
        if end <= n and prompt[p:end] == node.completion_ids:
            best = node  # the longest prefix: nodes after it are shorter, so none can be a deeper drift
            break
        if p == n:
            resampled = True
        else:
            drifted.append((p + _common_prefix(prompt[p:end], node.completion_ids), node))
    # Drift: a deeper timeline whose whole prompt this call repeats, but whose reply came back as other tokens.
    # (It must reach further into that timeline than `best` covers: an n>1 sibling of `best` does not count.)
    floor = best.seq_len if best is not None else -1
    drifted = [(common, node) for common, node in drifted if common > floor]
    if drifted:
        common, closest = max(drifted, key=lambda x: (x[0], -x[1].order))
        return best, _break(call, DRIFT, closest, common)
    if resampled:  # a sibling of that call's choices, under the same parent
        return best, Break(call.call_id, 0, N_BRANCH)
    if best is not None:
        return best, None
    if not earlier:
        if previous is None:
            return None, Break(call.call_id, 0, FIRST_CALL)
        if previous.requested_model == call.requested_model and previous.system_hash != call.system_hash:
            return None, Break(call.call_id, 0, SYSTEM_CHANGED)
        if previous.requested_model == call.requested_model and previous.tools_hash != call.tools_hash:
            return None, Break(call.call_id, 0, TOOLS_CHANGED)
        return None, Break(call.call_id, 0, NEW_ROLE)
    common, closest = max(((_shared(prompt, node), node) for node in earlier), key=lambda x: (x[0], -x[1].order))
    return None, _break(call, HISTORY_CHANGED, closest, common)


def _sub_agent(call: Call, answered: list[Call], tasks: dict[str, list]) -> Break | None:
    """A SUB_AGENT break when this call's user messages carry a string argument of a tool call that an
    earlier answered call made (the latest such call and tool call), else None. `tasks` caches each call's."""
    text = _user_text(call)
    if len(text) < _TASK_CHARS:
        return None
    for earlier in reversed(answered):
        if earlier.call_index >= call.call_index:
            continue
        if (handed := tasks.get(earlier.call_id)) is None:
            handed = tasks[earlier.call_id] = [
                (t.get("id") if isinstance(t, dict) else None, _string_arguments(t))
                for choice in earlier.choices for t in choice.tool_calls or ()]
        for tool_call_id, strings in handed:
            if any(s in text for s in strings):
                return Break(call.call_id, 0, SUB_AGENT, parent_call_id=earlier.call_id,
                             parent_tool_call_id=tool_call_id)
    return None


def _compaction(call: Call, answered: list[Call]) -> Break | None:
    """A COMPACTION break when this call's user messages carry a passage (80 characters or more) of the reply of an
    earlier answered call of the same named role and model name (the latest such call), else None. A passage: the
    reply's text between markup tags and blank lines, spaces collapsed (Claude Code keeps what its summary's
    <summary> tags held and drops the <analysis> before it)."""
    text = _user_text(call)
    if len(text) < _SUMMARY_CHARS:
        return None
    for earlier in reversed(answered):
        if earlier.call_index >= call.call_index or (earlier.role, earlier.requested_model) != (
                call.role, call.requested_model):
            continue  # the same agent goes on from its summary (its system prompt and tools may have changed)
        for choice in earlier.choices:
            if any(passage in text for passage in _passages(choice.text or "")):
                return Break(call.call_id, 0, COMPACTION, parent_call_id=earlier.call_id)
    return None


def _passages(reply: str) -> list[str]:
    """The parts of a reply, between markup tags and blank lines, long enough to tell a summary by."""
    parts = (_SPACE.sub(" ", part).strip() for part in _PASSAGE_BREAK.split(reply))
    return [part for part in parts if len(part) >= _SUMMARY_CHARS]


def _user_text(call: Call) -> str:
    """The text of a chat call's user messages, spaces collapsed ("" when there is none). A sub-agent's task may
    follow other user messages: Codex sends its environment first."""
    try:
        messages = orjson.loads(call.request).get("messages")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    texts = []
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
            elif isinstance(content, str):
                texts.append(content)
    return _SPACE.sub(" ", " ".join(texts)).strip()


def _string_arguments(tool_call: dict) -> list[str]:
    """The string values (at any depth) of a tool call's JSON arguments that are long enough to be a task, spaces
    collapsed."""
    function = tool_call.get("function") if isinstance(tool_call, dict) else None
    try:
        stack = [orjson.loads(function["arguments"])]
    except (TypeError, KeyError, orjson.JSONDecodeError):
        return []
    out = []
    while stack:
        value = stack.pop()
        if isinstance(value, str) and len(text := _SPACE.sub(" ", value).strip()) >= _TASK_CHARS:
            out.append(text)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return out


def _break(call: Call, reason: str, closest: _Node, common: int) -> Break:
    """Where this call's prompt leaves the closest earlier timeline, with a few tokens of each side."""
    ours = closest.seq()[common:common + _SHOWN]
    return Break(call.call_id, 0, reason, common, ours, call.prompt_ids[common:common + _SHOWN])


def _shared(prompt: list[int], node: _Node) -> int:
    """How many leading tokens the prompt shares with the node's prompt + completion."""
    common = _common_prefix(prompt, node.call.prompt_ids)
    if common < node.prompt_len:
        return common
    return common + _common_prefix(prompt[common:], node.completion_ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by bisecting on slice comparisons (C speed, not a Python loop per token)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _leaves(root: _Node) -> list[_Node]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(reversed(node.children))
        else:
            out.append(node)
    return out


def _sample(leaf: _Node, whole: list[str], cut_at: dict[tuple[str, int], str]) -> Sample:
    path = []
    node: _Node | None = leaf
    while node is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    mask: list[int] = []
    logprobs: list[float] = []
    covered = 0
    for node in path:
        context = node.prompt_len - covered  # new prompt tokens: tool results, user turns, template text
        mask += [0] * context
        logprobs += [0.0] * context
        mask += [1] * len(node.completion_ids)
        logprobs += node.logprobs
        covered = node.seq_len
    truncation = sorted({*whole, *(cut_at[k] for n in path if (k := (n.call.call_id, n.choice_index)) in cut_at)})
    return Sample(leaf.call.episode_id, leaf.call.role_key, [n.call.call_id for n in path],
                  [n.choice_index for n in path], leaf.seq(), mask, logprobs, truncation=truncation)


# --- summaries of merges -----------------------------------------------------------------------------------


def format_merge_summary(summary: dict) -> str:
    """A few lines for a terminal."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    ratio = "-" if summary["merge_ratio"] is None else f"{summary['merge_ratio']:.2f}x"
    reasons = ", ".join(f"{k} {v}" for k, v in summary["reasons"].items()) or "none"
    return "\n".join([
        f"merged {summary['episodes']} episodes ({summary['calls']} calls) into {summary['samples']} samples",
        f"merge ratio {ratio}: {summary['per_call_tokens']:,} tokens as per-call samples, "
        f"{summary['merged_tokens']:,} merged",
        f"drift rate {pct(summary['drift_rate'])}: {summary['drift_calls']} of {summary['followup_calls']} calls "
        "that continue an earlier call of their role came back re-tokenized",
        f"new timelines by reason: {reasons}",
    ])


def summarise_merges(merged: list[Merged]) -> dict:
    per_call, tokens = sum(m.per_call_tokens for m in merged), sum(m.merged_tokens for m in merged)
    drift, followups = sum(m.n_drift for m in merged), sum(m.n_followups for m in merged)
    reasons: dict[str, int] = {}
    for m in merged:
        for b in m.breaks:
            reasons[b.reason] = reasons.get(b.reason, 0) + 1
    return {"episodes": len(merged), "samples": sum(len(m.samples) for m in merged),
            "calls": sum(m.n_calls for m in merged), "per_call_tokens": per_call, "merged_tokens": tokens,
            "merge_ratio": per_call / tokens if tokens else None, "drift_calls": drift, "followup_calls": followups,
            "drift_rate": drift / followups if followups else None,
            "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))}
