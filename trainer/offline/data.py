"""What `harness train --from-run RUN` trains on: a recorded run's episodes, merged into samples again, with the
advantage each carries.

    episodes of offline.run that offline.where keeps (harness.store.export.episodes: reward, status, task_id, ...)
      -> their calls (store.database.EPISODE_CALLS, read through store.sql.Reader: a file a proxy is recording
         into is read through that proxy) -> merge_episode (the engine's own ids; and `retokenized` ones only with
         offline.allow_retokenized) -> the samples of the roles that train (roles.train) -> OfflineData

- loss sft: every chosen episode's samples, advantage 1 (a reward filter in offline.where makes it rejection-
  sampling fine-tuning).
- loss pg: each episode's outcome advantage (trainer.adv_estimator) against its task's group. The group is every
  judged episode of the task in the run (in a training run: in the same step), whatever offline.where keeps, as
  `harness export --records tokens` computes it. Failed episodes follow trainer.failed_episodes; unjudged ones
  carry no advantage. Samples whose advantage is exactly 0 (a group of one, or equal rewards) carry no signal and
  are left out, counted.

Merging again (instead of reading the `samples` table) uses the current merge for every run, whether or not its
samples were stored, and is where the opt-in for retokenized calls applies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.core.merge import merge_episode
from harness.core.records import ENGINE, FINISHED, NONE, RETOKENIZED, Sample
from harness.store.database import EPISODE_CALLS_NO_BODIES, calls_of
from harness.store.export import ExportError, episodes, group_of
from harness.store.sql import Reader, SqlError
from trainer.config import TrainConfig, run_dir
from trainer.config.roles import adapters_of, policy_of
from trainer.maths import algorithms as algo

log = logging.getLogger("harness.train")

_BATCH = 256  # episodes whose calls are read per query


class OfflineDataError(ValueError):
    """A recorded run that can't be trained on as configured; the message says why and what to do."""


@dataclass
class OfflineData:
    samples: list[Sample]
    advantages: list[float]  # per sample: 1.0 for sft; the episode's outcome advantage for pg
    metrics: dict[str, float] = field(default_factory=dict)  # what was chosen and what was left out, and why
    # per sample: the policy it trains (roles.policies, by the role its calls were recorded with), when the run
    # trains several (one adapter each); None with one policy
    policies: list[str] | None = None


def database_of(cfg: TrainConfig) -> Path:
    """The DuckDB holding offline.run: offline.db, else the experiment's own."""
    return Path(cfg.offline.db) if cfg.offline.db else run_dir(cfg) / "harness.duckdb"


def recorded_samples(cfg: TrainConfig) -> OfflineData:
    """The samples of offline.run that offline.where chooses, each with its advantage (see the module docstring).
    Calls are read and merged a batch of episodes at a time, without their request and response bodies."""
    o = cfg.offline
    db = database_of(cfg)
    sources = (ENGINE, RETOKENIZED) if o.allow_retokenized else (ENGINE,)
    samples, advantages, policies = [], [], []
    counts = {"text_only_calls": 0, "retokenized_calls_left_out": 0, "frozen_role_samples": 0,
              "no_signal_samples": 0, "unjudged_episodes": 0}
    try:
        with Reader(db) as reader:
            chosen = episodes(reader, o.run, o.where)
            if not chosen:
                raise OfflineDataError(f"offline.where {o.where!r} keeps none of run {o.run!r}'s episodes: loosen it "
                                       "(harness sql shows the run's rewards in episode_summary and judgements)")
            if o.loss == "pg":
                advantage = _advantages(episodes(reader, o.run) if o.where else chosen, cfg)
            else:
                advantage = {e["episode_id"]: 1.0 for e in chosen}
            for start in range(0, len(chosen), _BATCH):
                ids = [e["episode_id"] for e in chosen[start:start + _BATCH]]
                result = reader.query(EPISODE_CALLS_NO_BODIES, [ids])
                calls = calls_of(result.columns, result.rows)
                for episode_id in ids:
                    _merge_into(samples, advantages, policies, counts, calls.get(episode_id, []),
                                advantage.get(episode_id), sources, cfg)
    except (ExportError, SqlError) as exc:
        raise OfflineDataError(f"offline.run {o.run!r} in {str(db)!r}: {exc}") from None
    if not samples:
        raise OfflineDataError(_nothing_to_train(o, len(chosen), counts))
    metrics = {"offline/episodes": len(chosen), "offline/samples": len(samples),
               "offline/tokens_trained": sum(sum(s.loss_mask) for s in samples),
               **{f"offline/{k}": v for k, v in counts.items()}}
    several = adapters_of(cfg)
    for name in several:
        metrics[f"policy/{name}/offline/samples"] = policies.count(name)
    left = {k: v for k, v in counts.items() if v}
    log.info("run %s: %d of its episodes chosen, %d samples to train%s", o.run, len(chosen), len(samples),
             f"; left out: {left}" if left else "")
    return OfflineData(samples, advantages, metrics, policies if several else None)


def _merge_into(samples: list[Sample], advantages: list[float], policies: list[str], counts: dict[str, int],
                calls: list, advantage: float | None, sources: tuple[str, ...], cfg: TrainConfig) -> None:
    """One episode's calls merged, its samples that train appended with its advantage and its policy; what is left
    out, counted."""
    counts["text_only_calls"] += sum(c.token_source == NONE for c in calls)
    counts["retokenized_calls_left_out"] += sum(c.token_source == RETOKENIZED and RETOKENIZED not in sources
                                                for c in calls)
    if advantage is None:
        counts["unjudged_episodes"] += 1
        return
    by_id = {c.call_id: c for c in calls}
    for sample in merge_episode(calls, sources).samples:
        policy = policy_of(cfg, by_id[sample.call_ids[0]].extra.get("role"))
        if policy is None:
            counts["frozen_role_samples"] += 1
        elif advantage == 0.0:
            counts["no_signal_samples"] += 1
        else:
            samples.append(sample)
            advantages.append(advantage)
            policies.append(policy)


def _advantages(all_episodes: list[dict], cfg: TrainConfig) -> dict[str, float]:
    """Each judged episode's outcome advantage against its group (its task, in its harness run or training step:
    store/export.py group_of; trainer.adv_estimator); failed episodes dropped or scored 0 (trainer.failed_episodes).
    Episodes recorded without a task form groups of their own."""
    rewards, groups = {}, {}
    for e in all_episodes:
        reward, failed = e["reward"], e["status"] not in (None, FINISHED)
        if failed and cfg.trainer.failed_episodes == "zero_reward":
            reward = 0.0
        elif reward is None or failed:
            continue
        rewards[e["episode_id"]] = float(reward)
        groups[e["episode_id"]] = group_of(e) if e["task_id"] is not None else e["episode_id"]
    if not rewards:
        return {}
    values = torch.tensor(list(rewards.values()), dtype=torch.float64)
    adv = algo.outcome_advantages(values, list(groups.values()), cfg.trainer.adv_estimator)
    return dict(zip(rewards, adv.tolist(), strict=True))


def _nothing_to_train(o, n_chosen: int, counts: dict[str, int]) -> str:
    head = f"run {o.run!r}: the {n_chosen} chosen episodes give no sample to train"
    if counts["retokenized_calls_left_out"]:
        return (f"{head}: their calls' ids were made by `harness retokenize`, not the engine; to train on them, "
                "set offline.allow_retokenized: true (loss sft)")
    if counts["text_only_calls"]:
        return (f"{head}: their calls were recorded as text only (a hosted API returns no token ids). Run "
                "`harness retokenize --model DIR` and set offline.allow_retokenized: true, or export chat records "
                "(harness export --run RUN) and train with harness sft")
    if counts["no_signal_samples"] or counts["unjudged_episodes"]:
        return (f"{head}: no episode has an advantage (unjudged: {counts['unjudged_episodes']}, groups with equal "
                f"rewards or one member: {counts['no_signal_samples']} samples); pg needs judged groups of several "
                "episodes per task with different rewards (harness run --repeat N --judge ...)")
    if counts["frozen_role_samples"]:
        return f"{head}: all their samples belong to roles that do not train (roles.train)"
    return f"{head}: they have no answered calls"
