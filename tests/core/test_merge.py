"""The merger: calls that extend each other become one sequence; masks mark exactly the sampled tokens; every
call that starts a new timeline says why. Hand-made cases, then random call trees with drift injected."""

from __future__ import annotations

import random
from dataclasses import replace

import orjson
import pytest

from harness.core.merge import (
    COMPACTION,
    DRIFT,
    FIRST_CALL,
    HISTORY_CHANGED,
    N_BRANCH,
    NEW_ROLE,
    REASONS,
    REPLY_EDITED,
    SUB_AGENT,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
    format_merge_summary,
    merge_episode,
    summarise_merges,
)
from harness.core.records import ENGINE, ERROR, OK, Call, Choice


def call(index: int, prompt: list[int], *completions: list[int], role="r", model="m", system="s", tools=None,
         status=OK) -> Call:
    choices = [Choice(i, list(c), [-0.1 * (j + 1) for j in range(len(c))], "stop", "x")
               for i, c in enumerate(completions)]
    return Call(call_id=f"c{index}", run_id="run", episode_id="ep", call_index=index, endpoint="chat", stream=False,
                requested_model=model, served_model="p", role_key=role, system_hash=system, tools_hash=tools,
                request=b"{}", response=b"{}", prompt_ids=list(prompt), choices=choices, token_source=ENGINE,
                status=status, http_status=200, error=None, started_at=0.0, latency_ms=1.0, ttft_ms=None,
                weight_version=0)


def test_append_only_calls_merge_into_one_sequence_with_an_exact_mask():
    c0 = call(0, [1, 2, 3], [10, 11])
    c1 = call(1, [1, 2, 3, 10, 11, 4, 5], [12])  # tool result 4 5 between the turns
    c2 = call(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14])
    merged = merge_episode([c2, c0, c1])  # order comes from call_index
    [sample] = merged.samples
    assert sample.call_ids == ["c0", "c1", "c2"]
    assert sample.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.1, 0, -0.1, -0.2])
    assert [b.reason for b in merged.breaks] == [FIRST_CALL]
    assert merged.per_call_tokens == 5 + 8 + 11 and merged.merged_tokens == 11
    assert merged.merge_ratio == pytest.approx(24 / 11)


def test_retokenized_assistant_turn_is_drift_with_its_position():
    c0 = call(0, [1, 2, 3], [10, 11])
    c1 = call(1, [1, 2, 3, 10, 99, 4], [12])  # the template re-rendered the reply: 11 came back as 99
    merged = merge_episode([c0, c1])
    assert len(merged.samples) == 2
    drift = merged.breaks[1]
    assert (drift.call_id, drift.reason, drift.position) == ("c1", DRIFT, 4)
    assert drift.ours[0] == 11 and drift.theirs[0] == 99


def test_cut_history_is_history_changed():
    c0 = call(0, [1, 2, 3, 4], [10])
    c1 = call(1, [1, 2, 7, 4, 10, 5], [11])  # an earlier message was summarised
    merged = merge_episode([c0, c1])
    assert merged.breaks[1].reason == HISTORY_CHANGED and merged.breaks[1].position == 2


def test_roles_system_prompts_and_tools_start_their_own_timelines():
    calls = [call(0, [1, 2], [3]),
             call(1, [1, 2, 3, 4], [5], role="critic", model="critic-model"),
             call(2, [1, 2, 3, 4, 5, 6], [7]),  # the solver goes on: extends c0 across the critic's call
             call(3, [8, 9], [1], role="r2", system="other"),
             call(4, [8, 9, 1], [2], role="r3", system="other", tools="t")]
    merged = merge_episode(calls)
    assert [(b.call_id, b.reason) for b in merged.breaks] == [
        ("c0", FIRST_CALL), ("c1", NEW_ROLE), ("c3", SYSTEM_CHANGED), ("c4", TOOLS_CHANGED)]
    solver = next(s for s in merged.samples if s.role_key == "r")
    assert solver.call_ids == ["c0", "c2"]


def test_n2_branches_are_a_tree_and_the_next_call_follows_the_echoed_choice():
    c0 = call(0, [1, 2], [10, 11], [20, 21])
    c1 = call(1, [1, 2, 20, 21, 3], [30])
    merged = merge_episode([c0, c1])
    by_leaf = {tuple(s.call_ids): s for s in merged.samples}
    assert set(by_leaf) == {("c0",), ("c0", "c1")}
    assert by_leaf[("c0",)].token_ids == [1, 2, 10, 11]
    assert by_leaf[("c0", "c1")].token_ids == [1, 2, 20, 21, 3, 30]
    assert by_leaf[("c0", "c1")].loss_mask == [0, 0, 1, 1, 0, 1]
    assert by_leaf[("c0", "c1")].choice_indices == [1, 0]
    assert [(b.call_id, b.choice_index, b.reason) for b in merged.breaks] == [("c0", 0, FIRST_CALL),
                                                                               ("c0", 1, N_BRANCH)]


def test_choices_after_the_first_are_n_branch_siblings_whether_or_not_the_call_extends():
    c0 = call(0, [1, 2], [10])
    c1 = call(1, [1, 2, 10, 3], [11], [12], [13])  # extends c0: its first choice needs no Break
    c2 = call(2, [1, 2, 10, 3, 12, 4], [14])  # follows choice 1 of c1
    merged = merge_episode([c0, c1, c2])
    assert [(b.call_id, b.choice_index, b.reason) for b in merged.breaks] == [
        ("c0", 0, FIRST_CALL), ("c1", 1, N_BRANCH), ("c1", 2, N_BRANCH)]
    assert sorted((s.call_ids, s.choice_indices) for s in merged.samples) == [
        (["c0", "c1"], [0, 0]), (["c0", "c1"], [0, 2]), (["c0", "c1", "c2"], [0, 1, 0])]
    assert (merged.n_calls, merged.n_followups, merged.n_drift) == (3, 2, 0)


def test_a_drifted_n2_call_has_one_drift_and_one_branch():
    c0 = call(0, [1, 2], [10, 11])
    c1 = call(1, [1, 2, 10, 99, 3], [12], [13])
    merged = merge_episode([c0, c1])
    assert [(b.call_id, b.choice_index, b.reason, b.position) for b in merged.breaks] == [
        ("c0", 0, FIRST_CALL, None), ("c1", 0, DRIFT, 3), ("c1", 1, N_BRANCH, None)]
    assert merged.n_drift == 1 and merged.n_followups == 1


def test_a_call_that_repeats_an_earlier_prompt_is_an_n_branch_sibling_not_drift():
    c0 = call(0, [1, 2], [10])
    c1 = call(1, [1, 2, 10, 3], [11])
    retry = call(2, [1, 2, 10, 3], [12])  # the agent sent the same conversation again
    merged = merge_episode([c0, c1, retry])
    assert [(b.call_id, b.reason) for b in merged.breaks] == [("c0", FIRST_CALL), ("c2", N_BRANCH)]
    assert sorted(s.call_ids for s in merged.samples) == [["c0", "c1"], ["c0", "c2"]]
    assert merged.n_drift == 0


def test_failed_and_text_only_calls_are_not_trained():
    c0 = call(0, [1, 2], [3])
    bad = call(1, [1, 2, 3, 4], [5], status=ERROR)
    merged = merge_episode([c0, bad])
    assert [s.call_ids for s in merged.samples] == [["c0"]]


@pytest.mark.parametrize("seed", range(300))
def test_random_call_trees_merge_exactly(seed):
    """No false merge, no missed merge, a reason for every new timeline (n_branch for choices 1.. and retries),
    masks exact, and every sample is the concatenation of its calls' ids along its path."""
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(1000, 10**6) for _ in range(n)]

    calls: list[Call] = []
    kinds: dict[str, str] = {}
    parents: dict[str, tuple[str, int]] = {}  # extending call -> the (call, choice) it was built on
    drift_at: dict[str, int] = {}  # drifted call (or a retry of one) -> the position where it drifts
    retry_of: dict[str, str] = {}  # retry -> the first call that sent its prompt
    by_id: dict[str, Call] = {}
    for i in range(rng.randrange(1, 25)):
        roll = rng.random()
        role = rng.choice(["a", "b"])
        mine = [c for c in calls if c.role_key == role]
        if mine and roll < 0.6:  # extend an earlier choice of the same role
            parent = rng.choice(mine)
            choice = rng.choice(parent.choices)
            parents[f"c{i}"] = (parent.call_id, choice.index)
            # at least one token between turns, as a chat template always adds (role header, newline)
            prompt, kinds[f"c{i}"] = parent.prompt_ids + choice.completion_ids + tokens(rng.randrange(1, 4)), "extend"
        elif mine and roll < 0.7:  # a retry: the same prompt again
            again = rng.choice(mine)
            prompt, kinds[f"c{i}"] = list(again.prompt_ids), "retry"
            while kinds[again.call_id] == "retry":
                again = by_id[retry_of[again.call_id]]
            retry_of[f"c{i}"] = again.call_id
            if again.call_id in parents:
                parents[f"c{i}"] = parents[again.call_id]
            if again.call_id in drift_at:
                drift_at[f"c{i}"] = drift_at[again.call_id]
        elif mine and roll < 0.85:  # drift: the parent's reply came back with one token changed
            parent = rng.choice(mine)
            reply = list(rng.choice(parent.choices).completion_ids)
            changed = rng.randrange(len(reply))
            reply[changed] = rng.randrange(10, 1000)  # ids the generator never uses elsewhere
            drift_at[f"c{i}"] = len(parent.prompt_ids) + changed
            prompt, kinds[f"c{i}"] = parent.prompt_ids + reply + tokens(2), "drift"
        else:
            prompt, kinds[f"c{i}"] = tokens(rng.randrange(1, 6)), "fresh"
        completions = [tokens(rng.randrange(1, 5)) for _ in range(rng.choice([1, 1, 2, 3]))]
        calls.append(call(i, prompt, *completions, role=role))
        by_id[f"c{i}"] = calls[-1]

    merged = merge_episode(calls)
    reasons = {(b.call_id, b.choice_index): b for b in merged.breaks}
    assert len(reasons) == len(merged.breaks)  # at most one Break per choice
    for c in calls:
        first, *others = c.choices
        kind = kinds[c.call_id]
        assert ((c.call_id, first.index) in reasons) == (kind != "extend"), (c.call_id, kind)  # no false/missed merge
        if c.call_id in drift_at:
            drift = reasons[c.call_id, first.index]
            assert (drift.reason, drift.position) == (DRIFT, drift_at[c.call_id])
            assert drift.ours[0] != drift.theirs[0]
        elif kind == "retry":
            assert reasons[c.call_id, first.index].reason == N_BRANCH
        for choice in others:
            assert reasons[c.call_id, choice.index].reason == N_BRANCH
    assert (merged.n_calls, merged.n_drift) == (len(calls), len(drift_at))
    assert merged.n_followups == sum(any(e.role_key == c.role_key for e in calls[:i]) for i, c in enumerate(calls))

    seen = set()
    for sample in merged.samples:
        assert (sample.call_ids[0], sample.choice_indices[0]) in reasons  # every timeline's start says why
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for step, (cid, index) in enumerate(zip(sample.call_ids, sample.choice_indices, strict=True)):
            c = by_id[cid]
            if step and cid in parents:
                assert (sample.call_ids[step - 1], sample.choice_indices[step - 1]) == parents[cid]
            assert c.prompt_ids[:len(ids)] == ids  # the path so far is a true prefix of this call's prompt
            new = c.prompt_ids[len(ids):]
            completion = next(ch for ch in c.choices if ch.index == index)
            ids += new + completion.completion_ids
            mask += [0] * len(new) + [1] * len(completion.completion_ids)  # exactly the sampled tokens
            logprobs += [0.0] * len(new) + completion.logprobs
            seen.add((cid, index))
        assert (sample.token_ids, sample.loss_mask, sample.logprobs) == (ids, mask, logprobs)
    assert seen == {(c.call_id, ch.index) for c in calls for ch in c.choices}  # every choice is in some sample
    assert merged.merged_tokens == sum(len(s.token_ids) for s in merged.samples) <= merged.per_call_tokens


# --- replies the agent edited ------------------------------------------------------------------------------------

def edited(c: Call, message: int = 2, char: int = 5) -> Call:
    """The call as the proxy records it when the agent changed an earlier reply's words (proxy/continuity.py)."""
    return replace(c, extra={"continuity": {"mode": "chat", "reason": "reply_edited",
                                            "edited": {"message": message, "char": char, "parent_call": "c0"}}})


def test_a_drift_whose_call_records_an_edited_reply_is_reply_edited():
    c0 = call(0, [1, 2, 3], [10, 11, 12])
    c1 = edited(call(1, [1, 2, 3, 10, 13, 4], [14]))  # the agent cut the reply short: 11 12 came back as 13
    merged = merge_episode([c0, c1])
    assert [(b.call_id, b.reason, b.position) for b in merged.breaks] == [("c0", FIRST_CALL, None),
                                                                          ("c1", REPLY_EDITED, 4)]
    assert (merged.breaks[1].ours, merged.breaks[1].theirs) == ([11, 12], [13, 4])
    assert merged.n_drift == 0 and len(merged.samples) == 2 and REPLY_EDITED in REASONS
    summary = summarise_merges([merged])
    assert summary["drift_calls"] == 0 and summary["reasons"] == {FIRST_CALL: 1, REPLY_EDITED: 1}
    assert "reply_edited 1" in format_merge_summary(summary)


def test_an_edited_later_reply_merges_under_the_earlier_one_as_context():
    """Served token-exactly from the first reply, the edited second reply is context (mask 0) of one sample."""
    c0 = call(0, [1, 2], [10, 11])
    c1 = call(1, [1, 2, 10, 11, 3], [20, 21, 22])
    c2 = edited(call(2, [1, 2, 10, 11, 3, 20, 4], [30]), message=4)  # 21 22 cut: the edited reply ends early
    merged = merge_episode([c0, c1, c2])
    assert [(b.call_id, b.reason, b.position) for b in merged.breaks] == [("c0", FIRST_CALL, None),
                                                                          ("c2", REPLY_EDITED, 6)]
    by_leaf = {tuple(s.call_ids): s for s in merged.samples}
    assert set(by_leaf) == {("c0", "c1"), ("c0", "c2")}
    assert by_leaf[("c0", "c2")].loss_mask == [0, 0, 1, 1, 0, 0, 0, 1]


def test_only_drift_is_relabelled_and_only_by_an_edit_record():
    c0 = call(0, [1, 2, 3, 4], [10])
    cut = edited(call(1, [1, 2, 7, 4, 10, 5], [11]))  # the history changed before the reply: not the reply's edit
    assert merge_episode([c0, cut]).breaks[1].reason == HISTORY_CHANGED
    tidied = replace(call(1, [1, 2, 3, 4, 99, 5], [11]), extra={"continuity": {
        "mode": "chat", "reason": "render_failed", "normalised": [{"message": 2, "kind": "whitespace"}]}})
    assert merge_episode([c0, tidied]).breaks[1].reason == DRIFT  # served from the tidied text: it drifted
    exact = replace(call(1, [1, 2, 3, 4, 10, 5], [11]), extra=edited(c0).extra)
    assert [b.reason for b in merge_episode([c0, exact]).breaks] == [FIRST_CALL]  # nothing to relabel


# --- sub-agents: a timeline an earlier tool call handed its task to -----------------------------------------------

TASK = "Find every TODO in src/ and list the files, one per line."


def spawning(index: int, prompt: list[int], completion: list[int], arguments: dict, **kw) -> Call:
    """A call whose choice calls a tool (e.g. Claude Code's Agent, Codex's spawn_agent) with these arguments."""
    c = call(index, prompt, completion, **kw)
    tool_call = {"id": f"tc{index}", "type": "function",
                 "function": {"name": "Agent", "arguments": orjson.dumps(arguments).decode()}}
    return replace(c, choices=[replace(c.choices[0], tool_calls=[tool_call])])


def asking(c: Call, *messages: dict) -> Call:
    return replace(c, request=orjson.dumps({"model": "m", "messages": list(messages)}))


def test_a_timeline_whose_user_message_is_an_earlier_tool_calls_task_is_a_sub_agent_of_that_call():
    parent = [spawning(0, [1, 2, 3], [10, 11], {"description": "find todos", "prompt": TASK}),
              asking(call(1, [7, 8, 9], [20]),  # the sub-agent: its own system prompt, the task as its first message
                     {"role": "system", "content": "You are a search agent."},
                     {"role": "user", "content": "<environment>cwd: /src</environment>"},
                     {"role": "user", "content": [{"type": "text", "text": "<reminder>"},
                                                  {"type": "text", "text": TASK.replace(" ", "\n ", 2)}]}),
              call(2, [7, 8, 9, 20, 5], [21]),  # the sub-agent's next turn continues its own timeline
              call(3, [1, 2, 3, 10, 11, 4], [12])]  # the parent gets the sub-agent's answer and goes on
    merged = merge_episode(parent)
    assert [(b.call_id, b.reason) for b in merged.breaks] == [("c0", FIRST_CALL), ("c1", SUB_AGENT)]
    sub = merged.breaks[1]
    assert (sub.parent_call_id, sub.parent_tool_call_id, sub.position) == ("c0", "tc0", None)
    assert sorted(s.call_ids for s in merged.samples) == [["c0", "c3"], ["c1", "c2"]]  # merged apart, drift-free


def test_the_latest_matching_tool_call_is_the_parent_and_other_roles_can_spawn():
    calls = [spawning(0, [1, 2], [10], {"prompt": TASK}, role="planner", model="planner"),
             spawning(1, [1, 2, 10, 4], [11], {"prompt": TASK}, role="planner", model="planner"),
             asking(call(2, [7, 8], [20], role="worker", model="worker"), {"role": "user", "content": TASK})]
    merged = merge_episode(calls)
    assert [(b.call_id, b.reason, b.parent_call_id) for b in merged.breaks] == [
        ("c0", FIRST_CALL, None), ("c2", SUB_AGENT, "c1")]


@pytest.mark.parametrize("first_message, arguments", [
    (TASK, {"prompt": "Find every TODO in lib/."}),  # another task
    ("ls -la", {"cmd": "ls -la"}),  # short strings are commands, not tasks: a coincidence is likely
    (TASK, {"prompt": TASK[:-1] + "?"}),
])
def test_a_new_timeline_without_a_matching_tool_call_keeps_its_reason(first_message, arguments):
    calls = [spawning(0, [1, 2, 3, 4], [10], arguments),
             asking(call(1, [1, 2, 9, 4, 10, 5], [11]), {"role": "user", "content": first_message})]
    merged = merge_episode(calls)
    assert [(b.reason, b.parent_call_id) for b in merged.breaks] == [(FIRST_CALL, None), (HISTORY_CHANGED, None)]


SUMMARY = ("Summary of the conversation so far: the user asked to fix the failing test in mathutils.py; the mean "
           "divided by len + 1; I fixed it and the test passes.")


def summarising(c: Call, text: str) -> Call:
    return replace(c, choices=[replace(c.choices[0], text=text)])


def test_a_timeline_that_goes_on_from_an_earlier_reply_is_a_compaction_of_that_call():
    """Compaction as Claude Code and Codex do it: the history, a request to summarise it (the summary call continues
    the timeline), then a new conversation whose first user message carries the summary."""
    calls = [call(0, [1, 2, 3], [10, 11]),
             call(1, [1, 2, 3, 10, 11, 4], [12]),
             summarising(call(2, [1, 2, 3, 10, 11, 4, 12, 5, 6], [30, 31, 32]), SUMMARY),  # "summarise the above"
             asking(call(3, [1, 2, 40, 41, 42, 7], [13]),  # the same system prompt, the summary as its history
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "This session continues an earlier one, summarised below.\n"
                                                + SUMMARY.replace(" ", "\n", 3)}),
             call(4, [1, 2, 40, 41, 42, 7, 13, 8], [14])]  # and goes on from there
    merged = merge_episode(calls)
    assert [(b.call_id, b.reason, b.parent_call_id) for b in merged.breaks] == [
        ("c0", FIRST_CALL, None), ("c3", COMPACTION, "c2")]
    assert sorted(s.call_ids for s in merged.samples) == [["c0", "c1", "c2"], ["c3", "c4"]]  # merged apart


def test_a_summary_in_tags_is_found_by_its_passages_and_the_system_prompt_may_change():
    """Claude Code asks for <analysis> then <summary>, and goes on with what the summary tags held, under a system
    prompt that has changed meanwhile."""
    reply = f"<analysis>\nI looked at what was done.\n</analysis>\n\n<summary>\n{SUMMARY}\n</summary>"
    calls = [summarising(call(0, [1, 2, 3], [10]), reply),
             asking(call(1, [1, 2, 9, 4], [11], system="s2"),
                    {"role": "user", "content": "Summary below.\n" + SUMMARY})]
    merged = merge_episode(calls)
    assert [(b.reason, b.parent_call_id) for b in merged.breaks] == [(FIRST_CALL, None), (COMPACTION, "c0")]


@pytest.mark.parametrize("reply, model", [
    (SUMMARY[:60], "m"),  # too short to be a summary
    ("x" * 100, "m"),  # not in the message
    (SUMMARY, "another model"),  # another agent given the reply: a hand-off (named roles tell same-model ones apart)
])
def test_a_new_timeline_without_its_own_earlier_reply_in_it_is_no_compaction(reply, model):
    calls = [summarising(call(0, [1, 2, 3], [10]), reply),
             asking(call(1, [1, 2, 9, 4], [11], model=model), {"role": "user", "content": "go on: " + SUMMARY})]
    assert COMPACTION not in [b.reason for b in merge_episode(calls).breaks]


def test_a_call_that_continues_a_timeline_is_never_a_sub_agent():
    calls = [spawning(0, [1, 2], [10], {"prompt": TASK}),
             asking(call(1, [1, 2, 10, 4], [11]), {"role": "user", "content": TASK})]  # the task, quoted back
    assert [b.reason for b in merge_episode(calls).breaks] == [FIRST_CALL]
