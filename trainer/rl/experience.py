"""One training step's experience: which samples learn (the failed-episode policy, the trained roles), what
reward each carries (its episode's, or the judge's per-role one), which GRPO group it is compared in, and the
advantages that follow (`advantages_of`: per group; `gae_of`: per token, from a critic's values).

A sample's reward belongs to a *unit*: its episode, or, when roles are named (config `roles`), its episode and
role, so a solver and a critic of one episode can carry different rewards and are compared only with the same
role's samples of the same task.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.core.records import FINISHED, Sample
from trainer.config import TrainConfig, trains
from trainer.config.roles import adapters_of, policy_of
from trainer.maths import algorithms as algo
from trainer.model.fsdp import Dist
from trainer.rl.rollout import StepRollout, mean


@dataclass
class Experience:
    """One step's episodes that count for training, the same on every rank."""

    samples: list[Sample]  # every trained sample of the kept episodes
    rewards: dict[str, float]  # unit -> reward (failed episodes: dropped, or 0); see `units`
    groups: dict[str, str]  # unit -> its GRPO group: its task (and role, when roles are named)
    metrics: dict[str, float]
    call_spans: list[list[tuple[int, int, float]]] | None = None  # per sample, when the judge scored calls
    units: list[str] | None = None  # per sample, what its reward belongs to: its episode (and role); None: episode
    tasks: dict[str, str] | None = None  # unit -> task (mini-batches keep a task's samples together); None: groups
    versions: list[int] | None = None  # per sample, the oldest weight version its calls were sampled with
    baselines: dict[str, float] | None = None  # remax: task -> the reward of its greedy episode this step
    policies: list[str] | None = None  # per sample, the policy it trains (roles.policies); None: one policy

    def unit(self, i: int) -> str:
        return self.units[i] if self.units is not None else self.samples[i].episode_id

    def task(self, unit: str) -> str:
        return self.tasks[unit] if self.tasks is not None else self.groups[unit]


def experience_of(rollout: StepRollout, cfg: TrainConfig) -> Experience:
    """Which episodes count (the failed-episode policy), which of their samples learn (the trained roles), their
    rewards (the episode's, or the judge's per-role ones) and the rollout's metrics."""
    samples, units, rewards, groups, tasks, spans, versions, policies = [], [], {}, {}, {}, [], [], []
    failed = unjudged = frozen = 0
    per_role: dict[str, int] = {}
    for e in rollout.episodes:
        reward = e.reward
        failed += e.status != FINISHED
        if (e.status != FINISHED or reward is None) and not e.penalized:  # the guard's penalty is a reward to learn
            unjudged += e.status == FINISHED and reward is None
            if cfg.trainer.failed_episodes == "drop" or (reward is None and e.status == FINISHED):
                continue
            reward = 0.0
        for k, sample in enumerate(e.samples):
            role = e.sample_roles[k] if k < len(e.sample_roles) else None
            if not trains(cfg, role):
                frozen += 1
                continue
            unit = e.episode_id if role is None else f"{e.episode_id}\0{role}"
            judged = e.status == FINISHED and e.reward is not None and not e.penalized  # else the judge gives nothing
            rewards[unit] = e.role_rewards.get(role, reward) if judged else reward
            groups[unit] = e.task_id if role is None else f"{e.task_id}\0{role}"
            tasks[unit] = e.task_id
            samples.append(sample)
            units.append(unit)
            if role is not None:
                per_role[role] = per_role.get(role, 0) + 1
            spans.append(e.call_spans[k])
            versions.append(e.sample_versions[k])
            policies.append(policy_of(cfg, role))
    all_rewards = [e.reward for e in rollout.episodes if e.reward is not None]
    metrics = {
        "reward/mean": mean(all_rewards), "reward/max": max(all_rewards, default=None),
        "reward/min": min(all_rewards, default=None),
        "episodes/total": len(rollout.episodes), "episodes/failed": failed, "episodes/unjudged": unjudged,
        "episodes/truncated": sum(e.truncated > 0 for e in rollout.episodes),
        "episodes/ended_max_turns": sum(e.ended == "max_turns" for e in rollout.episodes),
        "samples/truncated": sum(bool(s.truncation) for e in rollout.episodes for s in e.samples),
        "samples/over_max_samples": sum(e.over_max_samples for e in rollout.episodes),
        "merge/ratio": rollout.merge.get("merge_ratio"), "merge/drift_rate": rollout.merge.get("drift_rate"),
        "time/rollout_s": rollout.timings["rollout_s"], "time/judge_s": rollout.timings["judge_s"],
        "time/merge_s": rollout.timings["merge_s"],
    }
    for reason in sorted({r for e in rollout.episodes for r in e.unparsed}):  # tool_call_unparsed, ...
        metrics[f"parse/{reason}"] = sum(e.unparsed.get(reason, 0) for e in rollout.episodes)
    if cfg.rollout.guard.enabled:
        metrics.update({"guard/degenerate": sum(e.degenerate for e in rollout.episodes),
                        "guard/episodes": sum(e.degenerate > 0 for e in rollout.episodes),
                        "guard/ended": sum(e.ended == "guard" for e in rollout.episodes),
                        "guard/penalized": sum(e.penalized for e in rollout.episodes)})
    if frozen:
        metrics["samples/frozen_roles"] = frozen
    metrics.update({f"samples/role/{name}": n for name, n in per_role.items()})
    if rollout.baselines is not None:
        metrics["remax/baseline_mean"] = mean(rollout.baselines.values())
        metrics["remax/tasks_without_baseline"] = len({e.task_id for e in rollout.episodes} - set(rollout.baselines))
    adapters = adapters_of(cfg)
    for name in adapters:  # with several policies: each one's samples and their units' mean reward
        mine = {units[i] for i, p in enumerate(policies) if p == name}
        metrics[f"policy/{name}/samples"] = sum(p == name for p in policies)
        metrics[f"policy/{name}/reward/mean"] = mean([rewards[u] for u in mine])
    return Experience(samples, rewards, groups, metrics, spans if any(spans) else None, units, tasks, versions,
                      rollout.baselines, policies if adapters else None)


def advantages_of(exp: Experience, old, ref, cfg: TrainConfig,
                  kl_coef: float | None = None) -> tuple[list[int], list[float], dict[str, float]]:
    """Each episode's advantage against its group (remax: against its task's greedy episode), given to its
    samples; the samples to train (indices).

    With `use_kl_in_reward`, an episode's reward first loses kl_coef (default trainer.kl_coef; the adaptive
    controller's current one) x its summed KL to the reference over all its sampled tokens (verl's token-level KL
    penalty, summed as the outcome estimators do)."""
    t = cfg.trainer
    kl_coef = t.kl_coef if kl_coef is None else kl_coef
    rewards = dict(exp.rewards)
    if t.use_kl_in_reward and kl_coef > 0:
        for i, (sample, lp, ref_lp) in enumerate(zip(exp.samples, old, ref, strict=True)):
            mask = torch.tensor(sample.loss_mask, dtype=lp.dtype)
            kl = float((algo.kl_penalty(lp, ref_lp, t.kl_type) * mask).sum())
            rewards[exp.unit(i)] -= kl_coef * kl
    episodes = list(rewards)
    by_group: dict[str, list[float]] = {}
    for e in episodes:
        by_group.setdefault(exp.groups[e], []).append(rewards[e])
    if t.adv_estimator == "remax":  # against the task's greedy episode; a task without one has no baseline
        baselines = exp.baselines or {}
        advantage = {e: rewards[e] - baselines[exp.task(e)] for e in episodes if exp.task(e) in baselines}
        flat = {exp.groups[e] for e in episodes if e not in advantage}
    else:
        values = torch.tensor([rewards[e] for e in episodes], dtype=torch.float64)
        adv = algo.outcome_advantages(values, [exp.groups[e] for e in episodes], t.adv_estimator) if episodes else []
        advantage = dict(zip(episodes, (float(a) for a in adv), strict=True))
        flat = {g for g, rs in by_group.items() if len(rs) < 2 or max(rs) - min(rs) < 1e-12}
    keep_flat = (kl_coef > 0 and not t.use_kl_in_reward) or t.entropy_coef > 0
    keep = [i for i in range(len(exp.samples)) if keep_flat or exp.groups[exp.unit(i)] not in flat]
    advantages: list = [advantage[exp.unit(i)] for i in keep]
    if exp.call_spans is not None:  # per-call rewards: normalised over the group's calls, on each call's tokens
        keep = [i for i in range(len(exp.samples)) if keep_flat or exp.groups[exp.unit(i)] not in flat
                or exp.call_spans[i]]
        advantages = _with_call_advantages(exp, keep, advantage, t.adv_estimator)
    lengths = [sum(exp.samples[i].loss_mask) for i in keep]
    return keep, advantages, {
        "groups/total": len(by_group), "groups/zero_variance": len(flat),
        "samples/trained": len(keep), "samples/tokens": sum(len(exp.samples[i].token_ids) for i in keep),
        "response/length_mean": mean(lengths), "response/length_max": max(lengths, default=None),
        "advantage/mean": mean(advantages), "advantage/abs_mean": mean([abs(a) for a in advantages]),
    }


def _with_call_advantages(exp: Experience, keep: list[int], outcome: dict[str, float], estimator: str) -> list:
    """Per-token advantages: the episode's outcome advantage on every sampled token, plus each scored call's
    advantage (its reward against the other scored calls of its group, with the same estimator) on its tokens.
    A call that appears in several samples of an episode (a shared prefix) counts once."""
    calls: dict[tuple[str, int, int], tuple[float, str]] = {}
    for i, spans in enumerate(exp.call_spans):
        unit = exp.unit(i)
        for start, end, reward in spans:
            calls.setdefault((unit, start, end), (reward, exp.groups[unit]))
    keys = list(calls)
    values = torch.tensor([calls[k][0] for k in keys], dtype=torch.float64)
    estimator = estimator if estimator in algo.ESTIMATORS else "grpo"  # remax: the calls have no greedy baseline
    call_adv = dict(zip(keys, algo.outcome_advantages(values, [calls[k][1] for k in keys], estimator).tolist(),
                        strict=True)) if keys else {}
    out = []
    for i in keep:
        sample, unit = exp.samples[i], exp.unit(i)
        tokens = torch.tensor(sample.loss_mask, dtype=torch.float32) * outcome.get(unit, 0.0)
        spans = [(s, e, call_adv[(unit, s, e)]) for s, e, _ in exp.call_spans[i]]
        out.append(tokens + algo.call_reward_tokens(len(sample.token_ids), spans, at="spread")
                   * torch.tensor(sample.loss_mask, dtype=torch.float32))
    return out


def gae_of(exp: Experience, old, ref, values: list[torch.Tensor], cfg: TrainConfig,
           kl_coef: float | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """adv_estimator gae: every sample's per-token advantages and returns (trainer/maths/estimators.py), from its
    episode's reward on its last sampled token, a judge's per-call rewards on each call's last token, and with
    use_kl_in_reward minus kl_coef x the per-token KL to the reference; whitened over the step's tokens."""
    from trainer.maths.estimators import gae_advantages

    t = cfg.trainer
    kl_coef = t.kl_coef if kl_coef is None else kl_coef
    n = len(exp.samples)
    width = max((len(s.token_ids) for s in exp.samples), default=1)
    mask, rewards, vals = (torch.zeros(n, width) for _ in range(3))
    for i, sample in enumerate(exp.samples):
        m = torch.tensor(sample.loss_mask, dtype=torch.float32)
        mask[i, :len(m)] = m
        vals[i, :len(m)] = values[i]
        trained = m.nonzero().squeeze(-1)
        if len(trained):
            rewards[i, int(trained[-1])] += exp.rewards[exp.unit(i)]
        for _start, end, reward in exp.call_spans[i] if exp.call_spans is not None else ():
            rewards[i, end - 1] += reward
        if t.use_kl_in_reward and kl_coef > 0:
            rewards[i, :len(m)] -= kl_coef * algo.kl_penalty(old[i], ref[i], t.kl_type) * m
    advantages, returns = gae_advantages(rewards, vals, mask, t.critic.gamma, t.critic.lam)
    rows = [(advantages[i, :len(s.token_ids)], returns[i, :len(s.token_ids)]) for i, s in enumerate(exp.samples)]
    valid = mask > 0
    lengths = [sum(s.loss_mask) for s in exp.samples]
    return [a for a, _ in rows], [r for _, r in rows], {
        "samples/trained": n, "samples/tokens": sum(len(s.token_ids) for s in exp.samples),
        "response/length_mean": mean(lengths), "response/length_max": max(lengths, default=None),
        "critic/values_mean": float(vals[valid].mean()) if valid.any() else None,
        "critic/returns_mean": float(returns[valid].mean()) if valid.any() else None,
        "advantage/abs_mean": float(advantages[valid].abs().mean()) if valid.any() else None,
    }


def mean_token_kl(samples: list[Sample], old, ref, kind: str) -> float | None:
    """The mean per-token KL to the reference over the trained tokens (what the adaptive controller steers)."""
    total = count = 0.0
    for sample, lp, ref_lp in zip(samples, old, ref, strict=True):
        m = torch.tensor(sample.loss_mask, dtype=lp.dtype)
        total += float((algo.kl_penalty(lp, ref_lp, kind) * m).sum())
        count += float(m.sum())
    return total / count if count else None


def broadcast(experience: Experience | None, dist: Dist) -> Experience:
    """Rank 0's experience, on every rank."""
    if dist.world == 1:
        return experience
    box = [experience]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
