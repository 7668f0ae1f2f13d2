"""The training loop's own arithmetic, without an engine: advantages from episodes (the failed-episode and
zero-variance policies, KL in the reward), the data order, the LR schedule, and gradient accumulation over
micro-batches giving the update of one pass over the mini-batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from harness.core.records import Sample
from harness.running.tiny_model import build_tiny_model
from trainer.config import load_config
from trainer.maths import algorithms as algo
from trainer.maths.algorithms import token_weights
from trainer.maths.schedule import lr_factor, next_tasks
from trainer.model.fsdp import init_distributed
from trainer.model.policy import collate, load_policy, token_logprobs
from trainer.rl.experience import Experience, advantages_of, gae_of
from trainer.rl.update import mini_batch

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return load_config(ROOT / "examples/train/terse.yaml", ["model.path=/nowhere", *overrides])


def _sample(episode: str, n: int, seed: int) -> Sample:
    rng = random.Random(seed)
    mask = [0] * 3 + [rng.choice((0, 1)) for _ in range(n - 4)] + [1]
    return Sample(episode, "role", ["c"], [0], [rng.randrange(2000) for _ in range(n)], mask,
                  [-rng.random() if m else 0.0 for m in mask])


def _experience() -> Experience:
    samples = [_sample("a1", 8, 1), _sample("a2", 9, 2), _sample("b1", 7, 3), _sample("b2", 6, 4),
               _sample("a2", 5, 5)]  # episode a2 has two samples (a branch)
    rewards = {"a1": 1.0, "a2": 0.0, "b1": 0.5, "b2": 0.5}
    groups = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}
    return Experience(samples, rewards, groups, {})


def test_advantages_follow_the_group_and_skip_groups_without_spread():
    exp = _experience()
    zeros = [torch.zeros(len(s.token_ids)) for s in exp.samples]
    keep, adv, metrics = advantages_of(exp, zeros, zeros, _cfg())
    assert keep == [0, 1, 4]  # group B (0.5, 0.5) carries no signal
    expected = algo.outcome_advantages(torch.tensor([1.0, 0.0]), ["A", "A"], "grpo")
    assert adv == pytest.approx([float(expected[0]), float(expected[1]), float(expected[1])])
    assert metrics["groups/zero_variance"] == 1 and metrics["samples/trained"] == 3
    # With an entropy bonus, flat groups stay (their gradient is not zero any more).
    keep, _, _ = advantages_of(exp, zeros, zeros, _cfg("trainer.entropy_coef=0.01"))
    assert keep == [0, 1, 2, 3, 4]


def test_kl_in_the_reward_lowers_each_episode_by_its_summed_kl():
    exp = _experience()
    old = [torch.tensor(s.logprobs) for s in exp.samples]
    ref = [lp - 0.5 * torch.tensor(s.loss_mask, dtype=torch.float32) for lp, s in zip(old, exp.samples, strict=True)]
    ref[2] = ref[2] - 1.0 * torch.tensor(exp.samples[2].loss_mask)  # b1 drifted further from the reference
    cfg = _cfg("trainer.kl_coef=0.1", "trainer.use_kl_in_reward=true", "trainer.kl_type=k1")
    keep, adv, _ = advantages_of(exp, old, ref, cfg)
    kl = [0.5 * sum(s.loss_mask) for s in exp.samples]
    kl[2] = 1.5 * sum(exp.samples[2].loss_mask)
    rewards = {"a1": 1.0 - 0.1 * kl[0], "a2": 0.0 - 0.1 * (kl[1] + kl[4]), "b1": 0.5 - 0.1 * kl[2],
               "b2": 0.5 - 0.1 * kl[3]}
    expected = algo.outcome_advantages(torch.tensor(list(rewards.values()), dtype=torch.float64),
                                       ["A", "A", "B", "B"], "grpo")
    by_episode = dict(zip(rewards, expected.tolist(), strict=True))
    assert keep == [0, 1, 2, 3, 4]  # the KL gave group B a spread
    assert adv == pytest.approx([by_episode[exp.samples[i].episode_id] for i in keep])


def test_tasks_come_in_shuffled_passes_that_a_resumed_run_continues():
    tasks = list(range(10))
    first, pos = next_tasks(tasks, 0, 4, True, 7)
    second, pos2 = next_tasks(tasks, pos, 8, True, 7)
    assert pos2 == 12 and sorted(first + second[:6]) == tasks  # one pass covers every task once
    assert next_tasks(tasks, 4, 8, True, 7)[0] == second  # from the saved position: the same tasks


def test_lr_warms_up_then_follows_the_schedule():
    f = lr_factor(2, "cosine", 10)
    assert [round(f(s), 3) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.0]
    assert lr_factor(0, "linear", 4)(2) == 0.5 and lr_factor(0, "constant", 4)(3) == 1.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "episode-mean"])
def test_micro_batches_accumulate_to_the_gradient_of_one_pass(tmp_path, mode):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    torch.manual_seed(0)
    rows = [_sample(f"e{i % 3}", 6 + 3 * i, i) for i in range(6)]
    advantages = [0.5, -1.0, 0.25, 1.0, -0.5, 0.75]
    cfg_one = _cfg(f"trainer.loss_agg_mode={mode}", "trainer.micro_batch_tokens=100000", "rollout.temperature=1.0")
    cfg_many = _cfg(f"trainer.loss_agg_mode={mode}", "trainer.micro_batch_tokens=30", "rollout.temperature=1.0")
    dist = init_distributed(device="cpu")
    grads = []
    for cfg in (cfg_one, cfg_many):
        model = load_policy(model_dir)
        model.eval()  # no dropout: the two passes see the same function
        with torch.no_grad():
            batch = collate(rows, 0)
            old_all, _ = token_logprobs(model, batch, 1.0, loss_only=True)
        old = [(old_all[i, :len(r.token_ids)] - 0.05) for i, r in enumerate(rows)]  # ratios away from 1
        weights = token_weights(rows, mode)
        mini_batch(model, rows, advantages, old, [None] * len(rows), weights, rows[0], 0, cfg, dist)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    worst = float((grads[0] - grads[1]).abs().max() / grads[0].abs().max())
    assert worst < 1e-5, worst  # episode-mean too, though episodes' rows are split across micro-batches here


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm", "episode-mean"])
def test_token_weights_reproduce_the_aggregation_mode(mode):
    rows = [_sample(f"e{i % 3}", 6 + 3 * i, i) for i in range(6)]
    values = [torch.randn(len(r.token_ids)) for r in rows]
    weighted = sum(float((v * w).sum()) for v, w in zip(values, token_weights(rows, mode), strict=True))
    batch = collate(rows, 0)
    padded = torch.zeros_like(batch.loss_mask)
    for i, v in enumerate(values):
        padded[i, :len(v)] = v
    constant = float(max(len(r.token_ids) for r in rows))
    expected = algo.aggregate(padded, batch.loss_mask, mode, batch.episode_index, constant)
    assert weighted == pytest.approx(float(expected), rel=1e-5)


def test_per_call_rewards_become_advantages_on_their_calls_tokens():
    from harness.core.merge import merge_episode
    from harness.core.records import OK, Call, Choice, Judgement
    from trainer.rl.rollout import _call_spans, call_rewards_of

    def call(episode, index, prompt, completion):
        return Call(f"{episode}-{index}", "run", episode, index, "chat", False, "m", "p", "r", None, None, b"{}",
                    None, prompt, [Choice(0, completion, [-0.5] * len(completion), "stop", "x")], "engine", OK, 200,
                    None, 0.0, 1.0, None, 0)

    episodes = {"e1": [call("e1", 0, [1, 2], [3, 4]), call("e1", 1, [1, 2, 3, 4, 5], [6])],
                "e2": [call("e2", 0, [1, 2], [7]), call("e2", 1, [1, 2, 7, 5], [8, 9])]}
    judged = {"e1": Judgement("e1", "j", "h", 1.0, {"call_rewards": [0.0, 1.0]}, None, 0.0),
              "e2": Judgement("e2", "j", "h", 0.0, {"call_rewards": {"1": 0.5}}, None, 0.0)}
    samples, spans, groups = [], [], {}
    for episode, calls in episodes.items():
        (sample,) = merge_episode(calls).samples
        samples.append(sample)
        spans.append(_call_spans(sample, calls, call_rewards_of(judged[episode], episode)))
        groups[episode] = "task"
    assert spans == [[(2, 4, 0.0), (5, 6, 1.0)], [(4, 6, 0.5)]]
    exp = Experience(samples, {"e1": 1.0, "e2": 0.0}, groups, {}, spans)
    zeros = [torch.zeros(len(s.token_ids)) for s in samples]
    keep, adv, _ = advantages_of(exp, zeros, zeros, _cfg())
    outcome = algo.outcome_advantages(torch.tensor([1.0, 0.0]), ["task", "task"], "grpo").tolist()
    calls_adv = algo.outcome_advantages(torch.tensor([0.0, 1.0, 0.5]), ["task"] * 3, "grpo").tolist()
    assert keep == [0, 1]
    assert adv[0].tolist() == pytest.approx([0, 0, outcome[0] + calls_adv[0], outcome[0] + calls_adv[0], 0,
                                             outcome[0] + calls_adv[1]])
    assert adv[1].tolist() == pytest.approx([0, 0, outcome[1], 0, outcome[1] + calls_adv[2],
                                             outcome[1] + calls_adv[2]])
    with pytest.raises(ValueError, match="call_rewards"):
        call_rewards_of(Judgement("e", "j", "h", 1.0, {"call_rewards": "high"}, None, 0.0), "e")


def test_named_roles_get_their_own_rewards_groups_and_frozen_roles_are_left_out():
    from harness.core.records import FINISHED, TIMED_OUT
    from trainer.rl.experience import experience_of
    from trainer.rl.rollout import EpisodeResult, StepRollout

    def episode(eid: str, status: str, reward: float, role_rewards: dict) -> EpisodeResult:
        samples = [_sample(eid, 6, 1), _sample(eid, 7, 2), _sample(eid, 5, 3)]
        return EpisodeResult(eid, "task", status, reward, samples, None, 0, [[], [], []],
                             ["solver", "critic", None], role_rewards, [0, 0, 0])

    rollout = StepRollout([episode("e1", FINISHED, 0.5, {"solver": 1.0, "critic": 0.0}),
                           episode("e2", FINISHED, 0.2, {"solver": 0.0}),
                           episode("e3", TIMED_OUT, 1.0, {"solver": 1.0})],  # judged, but it failed
                          {"rollout_s": 0.0, "judge_s": 0.0, "merge_s": 0.0}, {})
    cfg = _cfg("trainer.failed_episodes=zero_reward", "roles.match={solver: 'model:a', critic: 'model:b'}",
               "roles.upstream={critic: 'http://127.0.0.1:9/v1'}")
    exp = experience_of(rollout, cfg)
    units = [exp.unit(i) for i in range(len(exp.samples))]
    assert units == ["e1\0solver", "e1", "e2\0solver", "e2", "e3\0solver", "e3"]  # the critic's samples: out
    assert [exp.rewards[u] for u in units] == [1.0, 0.5, 0.0, 0.2, 0.0, 0.0]  # a failed episode gets 0, per role too
    assert {exp.groups[u] for u in units} == {"task\0solver", "task"}
    assert {exp.task(u) for u in units} == {"task"}
    assert exp.metrics["samples/frozen_roles"] == 3 and exp.metrics["samples/role/solver"] == 3
    # With roles.train naming the solver, only its samples learn.
    exp = experience_of(rollout, _cfg("roles.match={solver: 'model:a', critic: 'model:b'}", "roles.train=[solver]",
                                      "trainer.failed_episodes=zero_reward"))
    assert [exp.unit(i) for i in range(len(exp.samples))] == ["e1\0solver", "e2\0solver", "e3\0solver"]


def test_the_guard_s_penalty_is_a_reward_to_learn_even_when_the_agent_failed_on_the_refusal():
    """An episode the guard penalized (its agent crashed on the refused call) trains with the penalty, where a
    failed episode is dropped; past max_samples_per_episode samples are marked, kept out, and counted."""
    from dataclasses import replace

    from harness.core.merge import Merged
    from harness.core.records import CRASHED, FINISHED
    from trainer.rl.experience import experience_of
    from trainer.rl.rollout import EpisodeResult, StepRollout, _capped

    def episode(eid: str, status: str, reward: float | None, **guard) -> EpisodeResult:
        return EpisodeResult(eid, "task", status, reward, [_sample(eid, 6, 1)], None, 1, [[]], [None], {}, [0],
                             **guard)

    rollout = StepRollout([episode("ok", FINISHED, 0.5),
                           episode("bad", CRASHED, -1.0, degenerate=2, penalized=True, ended="guard"),
                           episode("crashed", CRASHED, None, ended="max_turns")],
                          {"rollout_s": 0.0, "judge_s": 0.0, "merge_s": 0.0}, {})
    exp = experience_of(rollout, _cfg("rollout.guard.enabled=true", "rollout.guard.penalty=-1"))
    assert [exp.unit(i) for i in range(len(exp.samples))] == ["ok", "bad"]  # failed_episodes drop: "crashed" goes
    assert exp.rewards == {"ok": 0.5, "bad": -1.0}
    m = exp.metrics
    assert (m["guard/degenerate"], m["guard/episodes"], m["guard/ended"], m["guard/penalized"]) == (2, 1, 1, 1)
    assert (m["episodes/failed"], m["episodes/ended_max_turns"]) == (2, 1)  # "bad" failed too, and still trains
    assert "guard/degenerate" not in experience_of(rollout, _cfg()).metrics  # the guard off: no guard metrics

    samples = [replace(_sample("e", 5, k), truncation=["max_tokens"] if k == 2 else []) for k in range(3)]
    merged = Merged(samples, [], 0, 0, 3, 2)
    capped, over = _capped(merged, 1, [True] * 3)
    assert over == 2 and capped.samples[0] == samples[0]
    assert [s.truncation for s in capped.samples] == [[], ["max_samples"], ["max_samples", "max_tokens"]]
    assert _capped(merged, 3, [True] * 3) == (merged, 0) and _capped(merged, None, [True] * 3) == (merged, 0)
    capped, over = _capped(merged, 1, [False, True, True])  # a frozen role's sample neither counts nor is marked
    assert over == 1 and [s.truncation for s in capped.samples] == [[], [], ["max_samples", "max_tokens"]]


# ---------------------------------------------------------------------------------------------- asynchronous rollouts


def test_stale_groups_are_dropped_whole_and_counted():
    """keep_fresh: a group whose oldest sample lags more than max_staleness versions goes, all of it (a GRPO group
    is never split); what stays reports its staleness."""
    from trainer.rl.async_rollouts import keep_fresh

    exp = _experience()
    exp.versions = [3, 2, 3, 3, 3]  # a2's first sample was sampled with version 2
    fresh, metrics = keep_fresh(exp, 3, max_staleness=1)
    assert fresh is exp and metrics["async/staleness_max"] == 1 and metrics["async/groups_dropped_stale"] == 0
    fresh, metrics = keep_fresh(exp, 4, max_staleness=1)  # group A lags 2 versions now
    assert [s.episode_id for s in fresh.samples] == ["b1", "b2"] and fresh.versions == [3, 3]
    assert set(fresh.rewards) == {"b1", "b2"} and set(fresh.groups) == {"b1", "b2"}
    assert (metrics["async/groups_dropped_stale"], metrics["async/samples_dropped_stale"],
            metrics["async/staleness_max"]) == (1, 3, 1)
    keep, _, _ = advantages_of(fresh, [torch.zeros(len(s.token_ids)) for s in fresh.samples], [None] * 2, _cfg())
    assert keep == []  # what is left (group B, rewards equal) carries no signal: nothing of group A trains


def test_rollouts_ahead_run_at_most_max_staleness_versions_ahead_in_order():
    import threading
    import time

    from trainer.rl.async_rollouts import RolloutsAhead

    started: list[tuple[int, int]] = []  # (step, the version served when its collect started)
    served = [0]
    release = threading.Event()

    def collect(step, tasks):
        started.append((step, served[0]))
        if step == 3:
            release.wait(5)
        return f"rollout {step} of {tasks}"

    ahead = RolloutsAhead(collect, [(s, [f"t{s}"]) for s in (1, 2, 3, 4)], max_staleness=1, served_version=0)
    try:
        assert ahead.take(1) == "rollout 1 of ['t1']"
        assert ahead.take(2) == "rollout 2 of ['t2']"  # collected while step 1 "trains"
        time.sleep(0.2)
        assert [s for s, _ in started] == [1, 2]  # step 3 waits for version 1
        served[0] = 1
        ahead.served(1)
        deadline = time.monotonic() + 5
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started == [(1, 0), (2, 0), (3, 1)]
        assert not ahead._alone.acquire(timeout=0.1)  # validation (ahead.alone) waits for the collect under way
    finally:
        release.set()
    assert ahead.take(3) == "rollout 3 of ['t3']"
    served[0] = 2
    ahead.served(2)
    assert ahead.take(4) == "rollout 4 of ['t4']" and started[-1] == (4, 2)
    ahead.close()


def test_a_failed_collect_is_raised_at_take_and_close_stops_waiting():
    from trainer.rl.async_rollouts import RolloutsAhead

    def collect(step, tasks):
        raise RuntimeError(f"the engine died during step {step}")

    ahead = RolloutsAhead(collect, [(1, []), (2, [])], max_staleness=2, served_version=0)
    with pytest.raises(RuntimeError, match="during step 1"):
        ahead.take(1)
    with pytest.raises(RuntimeError, match="ended before step 2"):
        ahead.take(2)
    waiting = RolloutsAhead(lambda s, t: s, [(1, []), (5, [])], max_staleness=1, served_version=0)
    assert waiting.take(1) == 1
    waiting.close(timeout_s=5)  # step 5 waits for version 3, which never comes: close ends the wait
    assert not waiting._thread.is_alive()


def test_remax_advantages_are_rewards_minus_the_task_s_greedy_reward():
    exp = _experience()
    exp.tasks = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}
    exp.baselines = {"A": 0.25}  # task B's greedy episode failed: no baseline, its samples are left out
    zeros = [torch.zeros(len(s.token_ids)) for s in exp.samples]
    keep, adv, metrics = advantages_of(exp, zeros, zeros, _cfg("trainer.adv_estimator=remax"))
    assert keep == [0, 1, 4]
    assert adv == [0.75, -0.25, -0.25]
    assert metrics["groups/zero_variance"] == 1


def test_gae_of_puts_the_reward_on_each_sample_s_last_sampled_token_and_the_kl_on_every_one():
    exp = _experience()
    cfg = _cfg("trainer.adv_estimator=gae", "trainer.kl_coef=0.5", "trainer.use_kl_in_reward=true",
               "trainer.kl_type=k1")
    old = [torch.full((len(s.token_ids),), -1.0) for s in exp.samples]
    ref = [torch.full((len(s.token_ids),), -1.2) for s in exp.samples]  # k1 = 0.2 a token
    values = [torch.zeros(len(s.token_ids)) for s in exp.samples]
    advantages, returns, metrics = gae_of(exp, old, ref, values, cfg)
    assert metrics["samples/trained"] == 5
    for i, sample in enumerate(exp.samples):
        trained = [k for k, m in enumerate(sample.loss_mask) if m]
        # gamma = lam = 1, values 0: each trained token's return is the reward minus 0.5 x 0.2 per trained token
        # from it to the end
        want = [exp.rewards[sample.episode_id] - 0.1 * (len(trained) - n) for n in range(len(trained))]
        assert returns[i][trained].tolist() == pytest.approx(want)
        assert all(returns[i][k] == 0 for k, m in enumerate(sample.loss_mask) if not m)
    # the advantages: those returns (values are 0), whitened over all the step's trained tokens
    width = max(len(s.token_ids) for s in exp.samples)
    mask = torch.zeros(5, width)
    padded = torch.zeros(5, width)
    for i, s in enumerate(exp.samples):
        mask[i, :len(s.token_ids)] = torch.tensor(s.loss_mask, dtype=torch.float32)
        padded[i, :len(s.token_ids)] = returns[i]
    flat = padded[mask > 0]
    want = (flat - flat.mean()) / (flat.std() + 1e-6)
    assert torch.cat([a[torch.tensor(s.loss_mask) > 0] for a, s in zip(advantages, exp.samples, strict=True)]) \
        .tolist() == pytest.approx(want.tolist(), abs=1e-5)


def test_the_critic_starts_at_zero_and_learns_the_returns(tmp_path):
    from trainer.model.critic import Critic

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    cfg = _cfg(f"model.path={model_dir}", "trainer.adv_estimator=gae", "trainer.critic.lr=1e-2",
               "trainer.ppo_epochs=4", "rollout.batch_size=2")
    critic = Critic(cfg, init_distributed("cpu"), total_steps=10)
    exp = _experience()
    values = critic.values(exp.samples, 0)
    assert all(v.abs().sum() == 0 for v in values)  # a zero head
    returns = [torch.tensor(s.loss_mask, dtype=torch.float32) * (1.0 if s.episode_id.startswith("a") else -1.0)
               for s in exp.samples]
    tasks = [s.episode_id[0] for s in exp.samples]
    first = critic.update(exp.samples, tasks, returns, values, 0)
    for _ in range(5):
        last = critic.update(exp.samples, tasks, returns, critic.values(exp.samples, 0), 0)
    assert last["critic/vf_loss"] < 0.5 * first["critic/vf_loss"]
    after = critic.values(exp.samples, 0)
    assert float(after[0][torch.tensor(exp.samples[0].loss_mask) > 0].mean()) > 0 > \
        float(after[2][torch.tensor(exp.samples[2].loss_mask) > 0].mean())
