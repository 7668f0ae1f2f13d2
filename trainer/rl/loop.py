"""`harness train config.yaml`: the closed RL loop, top to bottom.

Each step: a batch of tasks -> `num_repeat` episodes per task of the unmodified agent, through the recording proxy
-> judge -> merged samples (the engine's own ids, mask on the sampled tokens) -> old and reference logprobs ->
advantages per group -> `ppo_epochs` x mini-batches x micro-batches -> new weights into the running engine ->
metrics, validation, checkpoint.

Departures from textbook GRPO, all on purpose:
- A sample is a whole merged episode timeline (many calls), not one completion: tool results and user turns are
  context (mask 0); every sampled token of every call is trained once.
- The advantage is per episode (its outcome reward against its task's group), shared by all its samples.
- Failed episodes (crash, timeout, no answer, judge error) are dropped from their group (`failed_episodes: drop`)
  or scored 0 (`zero_reward`). Groups whose rewards are all equal carry no signal: their samples are left out of
  the update (counted in `groups/zero_variance`); with a KL or entropy term they stay in.
- Truncated replies (finish_reason "length") are trained as sampled, with the episode's reward, and counted.
- Old logprobs are the trainer's own at the rollout weights (so the PPO ratio starts at exactly 1); the engine's
  are used for the off-policy correction (`trainer.correction`, verl's: importance weights and rejection masks,
  once per step on the whole batch before the advantages) and the mismatch metrics `rollout_corr/*`,
  `logprob/engine_*`. With correction mode bypass the engine's are old instead.
- With `rollout.async.max_staleness` K, step s's episodes were collected on a thread while earlier steps trained
  (trainer/rl/async_rollouts.py), sampled with weights s-1-K and later: "old" is then the trainer at the weights being
  trained (the proximal policy), and a correction (required) weights or masks each token by trainer over engine.
- The learning rate schedule advances once per step; gradients of a mini-batch are accumulated over micro-batches
  with each micro-batch weighted by its share of the mini-batch's aggregation units (tokens, sequences or
  episodes, summed over ranks), so the update equals the one a single pass over the mini-batch would make.
- With several ranks, rank 0 runs the engine, the proxy, the agents and the judges; every rank trains on its
  share of each mini-batch (FSDP2). Engines and ranks sit on the GPUs `placement` gives them (harness/running/gpus.py).
- With `rollout.engine.sleep` N the engines sleep from the end of the step's episodes to the push: `POST
  /sleep?level=N` once the collect has returned (no episode runs then), `POST /wake_up` just before the push, which
  (level 2) loads the weights the engine dropped; the next step's episodes start after the push. Asynchronous
  rollouts would send episodes meanwhile: the config refuses the pair.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch

from harness.running.gpus import Placement
from harness.running.tasks import read_tasks
from harness.running.vllm_server import EngineError
from trainer.config import TrainConfig, run_dir, save_resolved
from trainer.config.checks import correction_of
from trainer.config.memory import placement_of
from trainer.config.roles import adapters_of
from trainer.maths.estimators import adaptive_kl_coef
from trainer.maths.schedule import next_tasks
from trainer.model.build import build_policy
from trainer.model.checkpoint import check_resume, find_resume, load, model_fingerprint, save, saved_state
from trainer.model.fsdp import Dist, init_distributed, shutdown
from trainer.rl.async_rollouts import RolloutsAhead, keep_fresh, plan_steps
from trainer.rl.correction import correct_step, still_trained
from trainer.rl.engines import push_weights, sleep_engines, wake_engines, weight_sync
from trainer.rl.experience import advantages_of, broadcast, experience_of, gae_of, mean_token_kl
from trainer.rl.lifecycle import seed_all, wind_down, write_trained
from trainer.rl.oom import oom_explained
from trainer.rl.rollout import greedy_baselines, start_rollouts, validate
from trainer.rl.tracking import log_metrics, tracker_for
from trainer.rl.update import score, update_policies

log = logging.getLogger("harness.train")


def train(cfg: TrainConfig) -> dict[str, float]:
    """Run the whole training; returns the last step's metrics."""
    placement = placement_of(cfg)  # checked at load: the GPUs of the engines and of each rank
    dist = init_distributed(gpus=placement.trainer_gpus if placement is not None else None)
    try:
        with oom_explained(cfg, dist.device):
            return _train(cfg, dist, placement)
    finally:
        shutdown()  # also when the run stops before its first step (bad tasks, a checkpoint of another run)


def _train(cfg: TrainConfig, dist: Dist, placement: Placement | None) -> dict[str, float]:
    # ---------------------------------------------------------------------------------------------- setup
    t = cfg.trainer
    seed = cfg.debug.seed if cfg.debug.enabled else t.seed
    seed_all(seed + dist.rank)
    out = run_dir(cfg)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg)
    tasks = read_tasks(cfg.data.train, split=cfg.data.split, limit=cfg.data.limit)
    val_tasks = read_tasks(cfg.data.validation, split=cfg.data.validation_split,
                           limit=cfg.data.validation_limit) if cfg.data.validation else []
    if cfg.debug.enabled:
        tasks, val_tasks = tasks[:cfg.debug.n_tasks], val_tasks[:cfg.debug.n_tasks]
    batch_size = min(cfg.rollout.batch_size, len(tasks))
    total_steps = t.total_steps or math.ceil(len(tasks) / batch_size)

    this_model, checkpoint = model_fingerprint(cfg, adapters_of(cfg)), find_resume(out, t.resume)
    if checkpoint is not None:  # before the model loads: a checkpoint of another run or model is refused at once
        check_resume(saved_state(checkpoint), checkpoint, "rl", model=this_model, experiment=cfg.experiment_name)
    # the policy (one LoRA adapter per policy with several), the reference (kl_coef > 0), the critic (gae)
    built = build_policy(cfg, dist, total_steps, "rl", adapters_of(cfg))
    model, optimizer, scheduler = built.model, built.optimizer, built.scheduler
    reference, critic, pad_id = built.reference, built.critic, built.pad_id

    start, data_pos, kl_coef = 0, 0, t.kl_coef
    if checkpoint is not None:
        state = load(checkpoint, model, optimizer, scheduler, dist)
        start, data_pos, kl_coef = state["step"], state["data_pos"], state.get("kl_coef", t.kl_coef)
        if critic is not None:
            critic.load(checkpoint)
        log.info("resumed from %s: continuing with step %d", checkpoint, start + 1)

    rollouts = sync = tracker = ahead = None
    if dist.is_main:
        log.info("GPUs: %s", placement.describe() if placement is not None else "none: engines and trainer on CPU")
        rollouts = start_rollouts(cfg, out)
        sync = weight_sync(rollouts, cfg, out)
        tracker = tracker_for(rollouts.store, rollouts.run_id, cfg)
        log.info("run %s: %d tasks, %d steps, curve at %s", rollouts.run_id, len(tasks), total_steps,
                 out / "curve.png")
    if start > 0 or built.lora is not None:  # the engine serves the checkpoint's weights (with LoRA: the adapter)
        push_weights(model, sync, dist, version=start)
    if t.val_before_train and val_tasks and start == 0:
        log_metrics(tracker, 0, validate(rollouts, 0, val_tasks, cfg) if dist.is_main else {})

    plan = plan_steps(start + 1, total_steps, lambda pos: next_tasks(tasks, pos, batch_size, cfg.data.shuffle,
                                                                     cfg.data.seed), data_pos)
    staleness = cfg.rollout.async_.max_staleness
    if staleness and dist.is_main:  # the next steps' episodes run while a step trains (trainer/rl/async_rollouts.py)
        ahead = RolloutsAhead(rollouts.collect, [(s, ts) for s, ts, _ in plan], staleness, served_version=start,
                              stop=rollouts.stop)
    metrics: dict[str, float] = {}
    correction = correction_of(cfg)  # checked at load
    sleep_level, asleep = cfg.rollout.engine.sleep if dist.is_main else 0, False
    try:
        for step, step_tasks, data_pos in plan:
            started = time.perf_counter()
            # ------------------------------------------------ 1. episodes, judged and merged (rank 0), to all ranks
            rollout = (ahead.take(step) if ahead else rollouts.collect(step, step_tasks)) if dist.is_main else None
            if t.adv_estimator == "remax" and dist.is_main:  # the baseline: one greedy episode per task
                rollout.baselines = greedy_baselines(rollouts, step, step_tasks, cfg)
            if sleep_level:  # the step's episodes are over: the engines' memory goes to the trainer until the push
                asleep = True  # (set first: if one of several engines fails to sleep, the others are woken)
                sleep_s = sleep_engines(rollouts, sleep_level)
            experience = broadcast(experience_of(rollout, cfg) if dist.is_main else None, dist)
            metrics = dict(experience.metrics)
            if sleep_level:
                metrics["time/sleep_s"] = sleep_s
            if staleness:  # the step trains weights version step - 1; time/rollout_wait_s: what overlap left
                experience, lag = keep_fresh(experience, step - 1, staleness)
                metrics.update(lag, **{"time/rollout_wait_s": time.perf_counter() - started})

            # ------------------------------------------------ 2. old and reference logprobs, at the rollout weights
            t0 = time.perf_counter()
            sampled = None
            if correction.bypass and reference is None:  # the engine's logprobs are old: nothing to score
                ref = [None] * len(experience.samples)
            else:
                old, ref, engine_diff = score(model, reference, experience, built.adapters, pad_id, cfg)
                metrics.update(engine_diff)
            metrics["time/logprobs_s"] = time.perf_counter() - t0
            if correction.bypass:  # weights and masks come per micro-batch, against the weights being trained
                old = [torch.tensor(r.logprobs) for r in experience.samples]
                is_weights = [None] * len(old)
            else:  # the correction, on the whole batch before the advantages (verl's order): rejected tokens untrained
                lags = [step - 1 - v for v in experience.versions] if staleness else None
                experience, is_weights, corrected, sampled = correct_step(experience, old, correction, lags)
                metrics.update(corrected)
                if correction.reject:  # which rows train must agree on every rank: rank 0's masks
                    experience = broadcast(experience if dist.is_main else None, dist)

            # ------------------------------------------------ 3. advantages: per group, or per token from the critic
            if critic is not None:  # gae: the critic's values before this step's update, then GAE over the tokens
                values = critic.values(experience.samples, pad_id)
                keep = list(range(len(experience.samples)))
                advantages, returns, adv_metrics = gae_of(experience, old, ref, values, cfg, kl_coef)
            else:
                keep, advantages, adv_metrics = advantages_of(experience, old, ref, cfg, kl_coef)
            metrics.update(adv_metrics)
            if correction.reject:  # a row whose every token was rejected trains nothing
                live, found = still_trained(experience, keep, sampled)
                metrics.update(found)
                keep, advantages = [keep[j] for j in live], [advantages[j] for j in live]
                if critic is not None:
                    returns, values = [returns[j] for j in live], [values[j] for j in live]
            rows = [experience.samples[i] for i in keep]
            old, ref, is_weights = [old[i] for i in keep], [ref[i] for i in keep], [is_weights[i] for i in keep]
            if t.use_kl_in_reward and t.kl_ctrl == "adaptive":  # the next step's coefficient, from this one's KL
                kl = mean_token_kl(rows, old, ref, t.kl_type) if rows else None
                metrics.update({"actor/kl_coef": kl_coef, "actor/kl_in_reward": kl})
                kl_coef = kl_coef if kl is None else adaptive_kl_coef(kl_coef, kl, t.kl_target, t.kl_horizon, len(rows))

            # ------------------------------------------------ 4. PPO epochs over mini-batches (the critic's too)
            t0 = time.perf_counter()
            tasks_of_rows = [experience.task(experience.unit(i)) for i in keep]
            if critic is not None:
                metrics.update(critic.update(rows, tasks_of_rows, returns, values, pad_id))
            if critic is None or step > t.critic.warmup_steps:  # the critic's warm-up: only the critic learns
                policies = [experience.policies[i] for i in keep] if built.adapters else None
                metrics.update(update_policies(model, optimizer, built.adapters, policies, rows, tasks_of_rows,
                                                advantages, old, ref, pad_id, cfg, dist, is_weights))
            scheduler.step()
            metrics["actor/lr"] = scheduler.get_last_lr()[0]
            metrics["time/train_s"] = time.perf_counter() - t0

            # ------------------------------------------------ 5. the new weights into the running engine
            if asleep:  # awake before the push, which (sleep level 2) loads the weights it dropped
                metrics["time/wake_s"], asleep = wake_engines(rollouts), False
            metrics.update(push_weights(model, sync, dist, version=step))

            # ------------------------------------------------ 6. validation, checkpoint, metrics
            validating = bool(val_tasks and t.test_freq and (step % t.test_freq == 0 or step == total_steps))
            # validation samples otherwise: no training episodes meanwhile, and none started before it
            with ahead.alone() if ahead is not None and validating else contextlib.nullcontext():
                if ahead is not None:
                    ahead.served(step)
                if validating:
                    metrics.update(validate(rollouts, step, val_tasks, cfg) if dist.is_main else {})
            if (t.save_freq and step % t.save_freq == 0) or step == total_steps:
                t0 = time.perf_counter()
                resume_state = {"mode": "rl", "model": this_model, "data_pos": data_pos, "kl_coef": kl_coef}
                save(out, step, model, optimizer, scheduler, resume_state, dist, keep_last=t.keep_checkpoints)
                if critic is not None:
                    critic.save(out, step, keep_last=t.keep_checkpoints)
                metrics["time/checkpoint_s"] = time.perf_counter() - t0
            metrics["time/step_s"] = time.perf_counter() - started
            log_metrics(tracker, step, metrics)
        write_trained(model, cfg, out, dist)
    finally:
        if ahead is not None:
            ahead.close()
        if asleep:  # a step failed while the engines slept: an engine the user started is left awake
            with contextlib.suppress(EngineError):
                wake_engines(rollouts)
        wind_down(tracker, rollouts)
    return metrics
