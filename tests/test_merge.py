"""The merger: calls that extend each other become one sequence; masks mark exactly the sampled tokens; every
call that starts a new timeline says why. Hand-made cases, then random call trees with drift injected."""

from __future__ import annotations

import random

import pytest

from harness.merge import (
    DRIFT,
    FIRST_CALL,
    HISTORY_CHANGED,
    NEW_ROLE,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
    merge_episode,
)
from harness.records import ENGINE, ERROR, OK, Call, Choice


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


def test_failed_and_text_only_calls_are_not_trained():
    c0 = call(0, [1, 2], [3])
    bad = call(1, [1, 2, 3, 4], [5], status=ERROR)
    merged = merge_episode([c0, bad])
    assert [s.call_ids for s in merged.samples] == [["c0"]]


@pytest.mark.parametrize("seed", range(200))
def test_random_call_trees_merge_exactly(seed):
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(1000, 10**6) for _ in range(n)]

    calls: list[Call] = []
    kinds: dict[str, str] = {}
    for i in range(rng.randrange(1, 25)):
        roll = rng.random()
        role = rng.choice(["a", "b"])
        mine = [c for c in calls if c.role_key == role]
        if mine and roll < 0.6:  # extend an earlier choice of the same role
            parent = rng.choice(mine)
            choice = rng.choice(parent.choices)
            # at least one token between turns, as a chat template always adds (role header, newline)
            prompt, kinds[f"c{i}"] = parent.prompt_ids + choice.completion_ids + tokens(rng.randrange(1, 4)), "extend"
        elif mine and roll < 0.8:  # drift: the parent's reply came back with one token changed
            parent = rng.choice(mine)
            reply = list(rng.choice(parent.choices).completion_ids)
            reply[rng.randrange(len(reply))] = rng.randrange(10, 1000)  # ids the generator never uses elsewhere
            prompt, kinds[f"c{i}"] = parent.prompt_ids + reply + tokens(2), "drift"
        else:
            prompt, kinds[f"c{i}"] = tokens(rng.randrange(1, 6)), "fresh"
        completions = [tokens(rng.randrange(1, 5)) for _ in range(rng.choice([1, 1, 2]))]
        calls.append(call(i, prompt, *completions, role=role))

    merged = merge_episode(calls)
    by_id = {c.call_id: c for c in calls}
    broke = {b.call_id for b in merged.breaks}
    for call_id, kind in kinds.items():
        assert (call_id in broke) == (kind != "extend"), (call_id, kind)  # no false merge, no missed merge
    for b in merged.breaks:
        if kinds[b.call_id] == "drift":
            assert b.reason == DRIFT
    seen = set()
    for sample in merged.samples:
        assert len(sample.token_ids) == len(sample.loss_mask) == len(sample.logprobs)
        expected_mask = [0] * len(sample.token_ids)
        for cid in sample.call_ids:
            c = by_id[cid]
            assert sample.token_ids[:len(c.prompt_ids)] == c.prompt_ids  # every step is a true prefix
            completion = next(ch.completion_ids for ch in c.choices
                              if sample.token_ids[len(c.prompt_ids):len(c.prompt_ids) + len(ch.completion_ids)]
                              == ch.completion_ids)
            for pos in range(len(c.prompt_ids), len(c.prompt_ids) + len(completion)):
                expected_mask[pos] = 1
            seen.add(cid)
        assert sample.loss_mask == expected_mask  # exactly the sampled tokens
    assert seen == set(by_id)  # every call is in some sample
    assert merged.merged_tokens <= merged.per_call_tokens
