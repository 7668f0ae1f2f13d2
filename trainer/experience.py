"""One training step's experience: which samples learn (the failed-episode policy, the trained roles), what
reward each carries (its episode's, or the judge's per-role one) and which GRPO group it is compared in.

A sample's reward belongs to a *unit*: its episode, or, when roles are named (config `roles`), its episode and
role, so a solver and a critic of one episode can carry different rewards and are compared only with the same
role's samples of the same task.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.records import FINISHED, Sample
from trainer.config import TrainConfig
from trainer.rollout import StepRollout


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

    def unit(self, i: int) -> str:
        return self.units[i] if self.units is not None else self.samples[i].episode_id

    def task(self, unit: str) -> str:
        return self.tasks[unit] if self.tasks is not None else self.groups[unit]


def experience_of(rollout: StepRollout, cfg: TrainConfig) -> Experience:
    """Which episodes count (the failed-episode policy), which of their samples learn (the trained roles), their
    rewards (the episode's, or the judge's per-role ones) and the rollout's metrics."""
    samples, units, rewards, groups, tasks, spans, versions = [], [], {}, {}, {}, [], []
    failed = unjudged = frozen = 0
    per_role: dict[str, int] = {}
    for e in rollout.episodes:
        reward = e.reward
        if e.status != FINISHED or reward is None:
            failed += e.status != FINISHED
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
            judged = e.status == FINISHED and e.reward is not None  # a failed episode's judge gives it nothing
            rewards[unit] = e.role_rewards.get(role, reward) if judged else reward
            groups[unit] = e.task_id if role is None else f"{e.task_id}\0{role}"
            tasks[unit] = e.task_id
            samples.append(sample)
            units.append(unit)
            if role is not None:
                per_role[role] = per_role.get(role, 0) + 1
            spans.append(e.call_spans[k])
            versions.append(e.sample_versions[k])
    all_rewards = [e.reward for e in rollout.episodes if e.reward is not None]
    metrics = {
        "reward/mean": mean(all_rewards), "reward/max": max(all_rewards, default=None),
        "reward/min": min(all_rewards, default=None),
        "episodes/total": len(rollout.episodes), "episodes/failed": failed, "episodes/unjudged": unjudged,
        "episodes/truncated": sum(e.truncated > 0 for e in rollout.episodes),
        "merge/ratio": rollout.merge.get("merge_ratio"), "merge/drift_rate": rollout.merge.get("drift_rate"),
        "time/rollout_s": rollout.timings["rollout_s"], "time/judge_s": rollout.timings["judge_s"],
        "time/merge_s": rollout.timings["merge_s"],
    }
    if frozen:
        metrics["samples/frozen_roles"] = frozen
    metrics.update({f"samples/role/{name}": n for name, n in per_role.items()})
    return Experience(samples, rewards, groups, metrics, spans if any(spans) else None, units, tasks, versions)


def trains(cfg: TrainConfig, role: str | None) -> bool:
    """Whether samples of this role learn: never a role served by another upstream; with roles.train set, only
    the roles it names; else every role."""
    if role is not None and role in cfg.roles.upstream:
        return False
    return not cfg.roles.train or role in cfg.roles.train


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
