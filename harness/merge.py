"""From recorded calls to training sequences: calls that extend each other merge into one timeline.

A call extends an earlier node (an earlier call's choice) of the same role when its prompt ids start with that
node's prompt ids + completion ids. The nodes form a prefix tree per role; every leaf is exported as one Sample
whose mask marks exactly the engine-sampled tokens (completion ids, mask 1, with their logprobs) and nothing
else (prompts, tool results, template text between turns: mask 0). Pure functions over records; no I/O.

Every call that does not continue the closest earlier timeline says why (`Break`): the first call of the
episode or of a role, a changed system prompt or tool list, a history that was cut or summarised, or
retokenization drift (the earlier assistant turn came back as different tokens), with the first differing
position and the tokens on both sides. A drifted call may still extend an ancestor of that timeline: it then
merges there, the drifted reply is context (mask 0) and its Break says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from harness.records import ENGINE, OK, Break, Call, Sample

FIRST_CALL = "first_call"  # the episode's first call
NEW_ROLE = "new_role"  # the first call of this role (another model name) in the episode
SYSTEM_CHANGED = "system_prompt_changed"  # same model name, another system prompt than the role before it
TOOLS_CHANGED = "tools_changed"  # same model name and system prompt, another tool list
HISTORY_CHANGED = "history_changed"  # the shared history differs before the last assistant turn (cut, summarised)
DRIFT = "retokenization_drift"  # the history matches up to an assistant turn, whose tokens came back different


@dataclass
class _Node:
    call: Call
    choice_index: int
    completion_ids: list[int]
    logprobs: list[float]
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return len(self.call.prompt_ids) + len(self.completion_ids)

    def seq(self) -> list[int]:
        return self.call.prompt_ids + self.completion_ids


@dataclass
class Merged:
    samples: list[Sample]
    breaks: list[Break]
    per_call_tokens: int  # tokens if every call's choice were its own sample
    merged_tokens: int  # tokens of the merged samples

    @property
    def merge_ratio(self) -> float:
        return self.per_call_tokens / self.merged_tokens if self.merged_tokens else 1.0


def mergeable(call: Call) -> bool:
    """Calls that can be trained on: answered, with the engine's own ids."""
    return call.status == OK and call.token_source == ENGINE and call.prompt_ids is not None


def merge_episode(calls: list[Call]) -> Merged:
    """Merge one episode's calls (any order; call_index decides) into samples, with a Break per new timeline."""
    calls = sorted((c for c in calls if mergeable(c)), key=lambda c: c.call_index)
    nodes_by_role: dict[str, list[_Node]] = {}
    breaks: list[Break] = []
    roots: list[_Node] = []
    previous: Call | None = None
    for call in calls:
        earlier = nodes_by_role.setdefault(call.role_key, [])
        parent, why = _best_parent(call, earlier, previous)
        for choice in call.choices:
            if choice.completion_ids is None:
                continue
            logprobs = list(choice.logprobs) if choice.logprobs is not None else [0.0] * len(choice.completion_ids)
            node = _Node(call, choice.index, list(choice.completion_ids), logprobs, parent)
            if parent is None:
                roots.append(node)
            else:
                parent.children.append(node)
            if why is not None:
                breaks.append(replace(why, choice_index=choice.index))
            earlier.append(node)
        previous = call
    samples = [_sample(leaf) for root in roots for leaf in _leaves(root)]
    per_call = sum(len(c.prompt_ids) + len(ch.completion_ids) for c in calls for ch in c.choices
                   if ch.completion_ids is not None)
    return Merged(samples, breaks, per_call, sum(len(s.token_ids) for s in samples))


def _best_parent(call: Call, earlier: list[_Node], previous: Call | None) -> tuple[_Node | None, Break | None]:
    """The deepest earlier node whose prompt + completion is a prefix of this call's prompt, and a Break when the
    call does not continue the closest earlier timeline."""
    prompt = call.prompt_ids
    best: _Node | None = None
    for node in earlier:
        if node.seq_len <= len(prompt) and (best is None or node.seq_len > best.seq_len) and _starts_with(
                prompt, node.call.prompt_ids, node.completion_ids):
            best = node
    floor = best.seq_len if best is not None else -1
    # Drift: a deeper timeline whose whole prompt this call repeats, but whose reply came back as other tokens.
    # (It must reach further into that timeline than `best` covers: an n>1 sibling of `best` does not count.)
    drifted = [(n, c) for n in earlier for c in (_common_prefix(prompt, n.seq()),)
               if len(n.call.prompt_ids) <= c < n.seq_len and c > floor]
    if drifted:
        closest, common = max(drifted, key=lambda x: x[1])
        return best, _break(call, DRIFT, closest, common)
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
    closest, common = max(((n, _common_prefix(prompt, n.seq())) for n in earlier), key=lambda x: x[1])
    return None, _break(call, HISTORY_CHANGED, closest, common)


def _break(call: Call, reason: str, closest: _Node, common: int) -> Break:
    """Where this call's prompt leaves the closest earlier timeline, with a few tokens of each side."""
    return Break(call.call_id, 0, reason, common, closest.seq()[common:common + 8], call.prompt_ids[common:common + 8])


def _starts_with(prompt: list[int], head: list[int], tail: list[int]) -> bool:
    n = len(head)
    return prompt[:n] == head and prompt[n:n + len(tail)] == tail


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _leaves(root: _Node) -> list[_Node]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(reversed(node.children))
        else:
            out.append(node)
    return out


def _sample(leaf: _Node) -> Sample:
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
        context = len(node.call.prompt_ids) - covered  # new prompt tokens: tool results, user turns, template text
        mask += [0] * context
        logprobs += [0.0] * context
        mask += [1] * len(node.completion_ids)
        logprobs += node.logprobs
        covered = node.seq_len
    return Sample(leaf.call.episode_id, leaf.call.role_key, [n.call.call_id for n in path], leaf.seq(), mask,
                  logprobs)
