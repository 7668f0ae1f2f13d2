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
import random
import time

import torch

from harness.core.records import Sample
from harness.running.gpus import Placement
from harness.running.tasks import read_tasks
from harness.running.vllm_server import EngineError
from trainer.config import TrainConfig, run_dir, save_resolved
from trainer.config.checks import correction_of
from trainer.config.memory import placement_of
from trainer.config.roles import adapters_of
from trainer.maths import algorithms as algo
from trainer.maths.estimators import adaptive_kl_coef
from trainer.maths.schedule import next_tasks
from trainer.model.build import build_policy
from trainer.model.checkpoint import check_resume, find_resume, load, model_fingerprint, save, saved_state
from trainer.model.fsdp import Dist, init_distributed, metrics_over_ranks, most_over_ranks, shutdown
from trainer.model.layout import computed_metrics
from trainer.model.lora import activate
from trainer.model.policy import collate, device_of, micro_batches, padded, to_device, token_logprobs
from trainer.rl.async_rollouts import RolloutsAhead, keep_fresh, plan_steps
from trainer.rl.correction import bypass_keys, bypass_measures, correct_step, still_trained
from trainer.rl.experience import advantages_of, experience_of, gae_of, mean_token_kl
from trainer.rl.oom import oom_explained
from trainer.rl.parts import (
    broadcast,
    by_policy,
    log_metrics,
    push_weights,
    seed_all,
    sleep_engines,
    tracker_for,
    validate,
    wake_engines,
    weight_sync,
    wind_down,
    write_trained,
)
from trainer.rl.rollout import greedy_baselines, start_rollouts

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
                old, ref, engine_diff = _score(model, reference, experience, built.adapters, pad_id, cfg)
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
                metrics.update(_update_policies(model, optimizer, built.adapters, policies, rows, tasks_of_rows,
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


# ---------------------------------------------------------------------------------------------- the step's parts


def _score(model, reference, experience, adapters: tuple[str, ...], pad_id: int, cfg: TrainConfig):
    """`_score_rows` over the step's samples; with several policies each policy's samples through its adapter, and
    the engine agreement per policy too."""
    rows = experience.samples
    if not adapters:
        return _score_rows(model, reference, rows, pad_id, cfg)
    old: list[torch.Tensor | None] = [None] * len(rows)
    ref: list[torch.Tensor | None] = [None] * len(rows)
    metrics: dict[str, float | None] = {}
    worst, total, count = None, 0.0, 0
    for name, idx in by_policy(adapters, experience.policies):
        activate(model, name)
        mine_old, mine_ref, diff = _score_rows(model, reference, [rows[i] for i in idx], pad_id, cfg)
        for k, i in enumerate(idx):
            old[i], ref[i] = mine_old[k], mine_ref[k]
        metrics.update({f"policy/{name}/{key}": value for key, value in diff.items()})
        n = sum(sum(rows[i].loss_mask) for i in idx)
        if diff["logprob/engine_max_abs_diff"] is not None:
            worst = max(worst or 0.0, diff["logprob/engine_max_abs_diff"])
            total, count = total + diff["logprob/engine_mean_abs_diff"] * n, count + n
    metrics.update({"logprob/engine_max_abs_diff": worst, "logprob/engine_mean_abs_diff": total / count if count
                    else None})
    return old, ref, metrics


@torch.no_grad()
def _score_rows(model, reference, rows: list[Sample], pad_id: int, cfg: TrainConfig):
    """The trainer's logprobs of every row at the rollout weights (and the reference's), and how far the
    trainer's are from the engine's on the sampled tokens (the same weights: they should agree to ~1e-3).

    Each micro-batch goes to the device in one copy; the logprobs and the differences stay there until the last
    micro-batch, then come back in one copy, so the host never waits inside the loop."""
    temperature, device = cfg.rollout.temperature, device_of(model)
    scored: list[torch.Tensor] = []  # per row in `order`: its logprobs, then (with a reference) the reference's
    order: list[int] = []
    worst, total = torch.zeros((), device=device), torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    layout = cfg.trainer.layout
    for idx in micro_batches(rows, cfg.trainer.micro_batch_tokens, layout) if rows else []:
        (batch,) = to_device(device, collate([rows[i] for i in idx], pad_id, indices=idx, layout=layout))  # one copy
        logprobs, _ = token_logprobs(model, batch, temperature, loss_only=True)
        diff = (logprobs - batch.engine_logprobs).abs() * batch.loss_mask
        worst, total = torch.maximum(worst, diff.max()), total + diff.sum().double()
        count += batch.n_trained
        ref_lp = token_logprobs(reference, batch, temperature, loss_only=True)[0] if reference is not None else None
        for row, i in enumerate(idx):
            n = len(rows[i].token_ids)
            order.append(i)
            scored += [logprobs[row, :n]] if ref_lp is None else [logprobs[row, :n], ref_lp[row, :n].to(device)]
    old: list[torch.Tensor | None] = [None] * len(rows)
    ref: list[torch.Tensor | None] = [None] * len(rows)
    if not order:
        return old, ref, {"logprob/engine_max_abs_diff": None, "logprob/engine_mean_abs_diff": None}
    # the one read: both differences and every row's logprobs (float32 -> float64 -> float32 is exact)
    host = torch.cat([worst.double().view(1), total.view(1), *(lp.double() for lp in scored)]).cpu()
    worst_diff, total_diff = host[:2].tolist()
    pieces = host[2:].float().split([len(lp) for lp in scored])
    per_row = len(pieces) // len(order)  # 1, or 2 with a reference
    for k, i in enumerate(order):
        old[i] = pieces[k * per_row]
        if reference is not None:
            ref[i] = pieces[k * per_row + 1]
    return old, ref, {"logprob/engine_max_abs_diff": worst_diff if count else None,
                      "logprob/engine_mean_abs_diff": total_diff / count if count else None}


def _update_policies(model, optimizer, adapters: tuple[str, ...], policies: list[str] | None, rows, tasks_of_rows,
                     advantages, old, ref, pad_id: int, cfg: TrainConfig, dist: Dist, is_weights=None) -> dict:
    """`_update` over the rows; with several policies, over each policy's rows through its adapter in turn, with its
    own gradient clipping and optimizer steps (the AdamW moves only the parameters that have gradients: the
    active adapter's), metrics under `policy/<name>/`. A policy without rows this step is left as it was."""
    if not adapters:
        return _update(model, optimizer, rows, tasks_of_rows, advantages, old, ref, pad_id, cfg, dist, is_weights)
    metrics: dict[str, float] = {}
    weighted: dict[str, float] = {}
    tokens = computed = 0.0
    for name, idx in by_policy(adapters, policies):
        activate(model, name)
        mine = _update(model, optimizer, [rows[i] for i in idx], [tasks_of_rows[i] for i in idx],
                       [advantages[i] for i in idx], [old[i] for i in idx], [ref[i] for i in idx], pad_id, cfg, dist,
                       None if is_weights is None else [is_weights[i] for i in idx])
        mine["advantage/abs_mean"] = sum(abs(advantages[i]) for i in idx) / len(idx)
        metrics.update({f"policy/{name}/{key}": value for key, value in mine.items()})
        for key in (k for k in mine if k.startswith("rollout_corr/")):  # bypass: token means over the policies
            weighted[key] = weighted.get(key, 0.0) + mine[key] * mine.get("update/tokens", 0.0)
        tokens += mine.get("update/tokens", 0.0)
        computed += mine.get("update/tokens_computed", 0.0)
    if computed:
        metrics.update({"update/tokens": tokens, "update/tokens_computed": computed,
                        "update/computed_ratio": tokens / computed})
    if tokens:
        metrics.update({key: value / tokens for key, value in weighted.items()})
    return metrics


def _update(model, optimizer, rows, tasks_of_rows, advantages, old, ref, pad_id: int, cfg: TrainConfig,
            dist: Dist, is_weights=None) -> dict:
    """ppo_epochs passes over the rows in mini-batches of whole groups (the rows of `mini_batch_size` tasks);
    one optimizer step per mini-batch, whose metrics (and gradient norm) the host reads once, after the step.
    `is_weights`: per row its importance weights (trainer/rl/correction.py), or None (none)."""
    t = cfg.trainer
    n_mini = max(1, cfg.rollout.batch_size // (t.mini_batch_size or cfg.rollout.batch_size))
    sums: dict[str, float] = {}
    steps = 0
    computed = 0  # positions the forward computed in the first pass over the rows (this rank's)
    rng = random.Random(t.seed)
    tasks = list(dict.fromkeys(tasks_of_rows))
    for epoch in range(t.ppo_epochs if rows else 0):
        rng.shuffle(tasks)
        for k in range(min(n_mini, len(tasks))):
            chosen = set(tasks[k::n_mini])
            mini = [i for i, task in enumerate(tasks_of_rows) if task in chosen]
            weights = algo.token_weights([rows[i] for i in mini], t.loss_agg_mode)  # over the whole mini-batch
            mine = _share([rows[i] for i in mini], dist, t.layout)  # this rank's share of it
            stats, positions = _mini_batch(model, [rows[mini[j]] for j in mine], [advantages[mini[j]] for j in mine],
                                           [old[mini[j]] for j in mine], [ref[mini[j]] for j in mine],
                                           [weights[j] for j in mine], rows[0], pad_id, cfg, dist,
                                           None if is_weights is None else [is_weights[mini[j]] for j in mine])
            computed += positions if epoch == 0 else 0
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
                grad_norm = grad_norm.full_tensor()
            values = torch.stack([*stats.values(), grad_norm.to(torch.float64)]).tolist()  # the one read
            stats = metrics_over_ranks(dict(zip(stats, values[:-1], strict=True)),
                                       sum(sum(rows[mini[j]].loss_mask) for j in mine), dist, _SUMMED, _MAXED)
            stats["actor/grad_norm"] = values[-1]
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            steps += 1
    if not steps:
        return {}
    return {**{key: value / steps for key, value in sums.items()}, **computed_metrics(rows, computed, dist)}


def _share(rows: list[Sample], dist: Dist, layout: str) -> list[int]:
    """The positions of this rank's rows: every world-th one; for the tree layout, a run of rows in token order
    instead, so the rows that share prefixes share a rank (and its trees)."""
    if layout != "tree":
        return list(range(dist.rank, len(rows), dist.world))
    order = sorted(range(len(rows)), key=lambda i: rows[i].token_ids)
    return sorted(order[dist.rank * len(rows) // dist.world:(dist.rank + 1) * len(rows) // dist.world])


_SUMMED = ("actor/pg_loss", "actor/entropy", "actor/kl")  # weighted sums of a mini-batch's parts: add up over ranks
_MAXED = ("actor/ratio_max",)  # the largest over ranks


def _mini_batch(model, rows, advantages, old, ref, weights, filler: Sample, pad_id: int, cfg: TrainConfig,
                dist: Dist, is_weights=None) -> tuple[dict[str, torch.Tensor], int]:
    """Accumulate the gradient of this rank's rows of one mini-batch over micro-batches; returns its metrics as
    float64 scalars on the model's device (the caller reads them once), and the positions its forwards computed
    (trainer.layout decides how many: the samples' tokens, their padding, or each shared prefix once).

    Each micro-batch is built on the host and moved in one copy (to_device); its loss and metrics are computed
    on the device and nothing is read back inside the loop. Every rank runs as many forward/backward passes as
    the busiest one (FSDP's collectives must pair up): a rank with fewer micro-batches runs `filler` with zero
    weight.

    Each token's loss is weighted by its importance weight (`is_weights`, per row; decoupled correction). With
    trainer.correction.mode bypass the engine's logprobs are old, and the weights and rejection masks are taken
    here against the logprobs of the weights being trained, as verl's bypass loss does (ppo_clip: the weights only
    measured; reinforce: -advantage x logprob x weight); their `rollout_corr/` means come with the metrics."""
    t = cfg.trainer
    correction = correction_of(cfg)
    device = device_of(model)
    groups = micro_batches(rows, t.micro_batch_tokens, t.layout) if rows else []
    passes = most_over_ranks(len(groups), dist)
    all_tokens = max(sum(sum(r.loss_mask) for r in rows), 1)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums = {"actor/pg_loss": zero, "actor/entropy": zero}
    if t.kl_coef > 0:
        sums = {"actor/kl": zero, **sums}
    if correction.bypass:
        sums.update({f"rollout_corr/{key}": zero for key in bypass_keys(correction)})
    policy = torch.zeros(len(algo.POLICY_METRICS), dtype=torch.float64, device=device)
    computed = 0
    weighted = is_weights is not None and any(v is not None for v in is_weights)
    for n in range(passes):
        if n < len(groups):
            idx = groups[n]
            batch = collate([rows[i] for i in idx], pad_id, indices=idx, layout=t.layout)
            mask = batch.loss_mask
            w = padded([weights[i] for i in idx], mask)
            old_lp, adv = padded([old[i] for i in idx], mask), _pad_advantages([advantages[i] for i in idx], mask)
            ref_lp = padded([ref[i] for i in idx], mask) if t.kl_coef > 0 else torch.zeros_like(mask)
            isw = padded([is_weights[i] for i in idx], mask) if weighted else None
        else:
            batch = collate([filler], pad_id)
            mask = batch.loss_mask
            w = torch.zeros_like(mask)
            old_lp, adv, ref_lp = batch.engine_logprobs, torch.zeros_like(mask), batch.engine_logprobs
            isw = torch.zeros_like(mask) if weighted else None
        batch, w, old_lp, adv, ref_lp, *isw = to_device(device, batch, w, old_lp, adv, ref_lp,
                                                         *([] if isw is None else [isw]))  # the one copy
        isw = isw[0] if isw else None
        mask = batch.loss_mask
        logprobs, entropy = token_logprobs(model, batch, cfg.rollout.temperature, with_entropy=True, loss_only=True,
                                           offload_activations=cfg.model.activation_offload)

        if correction.bypass:  # old is the engine's: weights and masks against the weights being trained
            isw, kept, _ = correction.apply(logprobs.detach(), old_lp, mask, measure=False)
            if n < len(groups):
                share = batch.n_trained / all_tokens
                for key, value in bypass_measures(correction, logprobs.detach(), old_lp, mask, kept, isw).items():
                    sums[f"rollout_corr/{key}"] = sums[f"rollout_corr/{key}"] + value * share
            isw = kept if isw is None or not correction.reinforce else isw * kept  # rejected: out of the pg loss
        if correction.reinforce:  # REINFORCE: -A x logprob x weight; the ratio to the engine only measured
            losses = -adv * logprobs
            log_ratio = (logprobs - old_lp).detach().clamp(-20.0, 20.0)
        else:
            losses, log_ratio = algo.ppo_token_losses(logprobs, old_lp, adv, clip_low=t.clip_low,
                                                      clip_high=t.clip_high, dual_clip=t.dual_clip)
        pg_loss = ((losses if isw is None else losses * isw) * w).sum()  # sum(weight x loss): this micro-batch's part
        pg_stats = algo.policy_metric_values(log_ratio, adv, mask, t.clip_low, t.clip_high, t.dual_clip)
        loss = pg_loss
        if t.kl_coef > 0:
            kl = (algo.kl_penalty(logprobs, ref_lp, t.kl_type) * w).sum()
            if not t.use_kl_in_reward:  # else it is in the reward already; still measured
                loss = loss + t.kl_coef * kl
            sums["actor/kl"] = sums["actor/kl"] + kl.detach().double()
        ent = (entropy * w).sum()
        if t.entropy_coef > 0:
            loss = loss - t.entropy_coef * ent
        (loss * dist.world).backward()  # FSDP averages gradients over ranks: undo it, the weights are global
        sums["actor/pg_loss"] = sums["actor/pg_loss"] + pg_loss.detach().double()
        sums["actor/entropy"] = sums["actor/entropy"] + ent.detach().double()
        if n < len(groups):  # the filler's metrics are no part of the mini-batch's
            policy = algo.add_policy_metrics(policy, pg_stats, batch.n_trained / all_tokens)
            computed += batch.n_computed
    return {**sums, **{f"actor/{key}": value for key, value in zip(algo.POLICY_METRICS, policy, strict=True)}}, computed


# ---------------------------------------------------------------------------------------------- small helpers


def _pad_advantages(values: list, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per sample (a number for all its sampled tokens, or a tensor per token), padded to [B, T]."""
    out = torch.zeros_like(mask)
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            out[i, :len(value)] = value
        else:
            out[i] = value * mask[i]
    return out


