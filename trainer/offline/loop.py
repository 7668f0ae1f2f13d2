"""Training without rollouts, top to bottom: `harness train --from-run RUN` (recorded episodes) and `harness sft`
(chat records). The same policy, optimiser, schedule, checkpoints, metrics and validation as `harness train`
(trainer/rl/loop.py); only where the samples come from and the loss differ.

    samples (trainer/offline/data.py: a recorded run, merged again; trainer/offline/chat_data.py: chat records,
    tokenised with the model's chat template) -> offline.epochs passes in shuffled batches of offline.batch_size
    -> per batch, micro-batches of trainer.micro_batch_tokens, one optimizer step -> validation with the agent,
    checkpoints, metrics -> the final weights as a model directory (<run dir>/hf)

The two losses, over the tokens the model sampled (the mask), averaged as trainer.loss_agg_mode says:
- sft: the negative log-likelihood at temperature 1. On the episodes a reward filter keeps, this is rejection-
  sampling fine-tuning; on chat records, plain supervised fine-tuning.
- pg: the PPO-clipped surrogate with the stored sampling logprobs as the old policy, so each token's importance
  ratio is trained policy / sampling policy, clipped to [1 - clip_low, 1 + clip_high] (dual clip on negative
  advantages): off-policy correction against exactly the distribution the engine sampled from. Scored at
  rollout.temperature, which must be the run's sampling temperature; `logprob/behaviour_mean_abs_diff` on step 1
  says whether the trainer and the stored logprobs agree (a wrong model or temperature shows there).

Validation (data.validation with rollout.agent) starts the engine and the proxy, and pushes the weights before
each validation, as `harness train` does; without it no engine is started. `offline/data_nll` is the mean NLL of
every training sample's trained tokens, before the first step and after each epoch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
import uuid

import duckdb
import torch

import harness
from harness.core.records import Sample
from harness.running.tasks import read_tasks
from harness.store.database import Store
from trainer.config import Mode, TrainConfig, config_to_dict, run_dir, save_resolved
from trainer.config.memory import placement_of
from trainer.config.roles import adapters_of
from trainer.maths import algorithms as algo
from trainer.model.build import build_policy
from trainer.model.checkpoint import check_resume, find_resume, load, model_fingerprint, save, saved_state
from trainer.model.fsdp import Dist, init_distributed, metrics_over_ranks, most_over_ranks, shutdown
from trainer.model.layout import computed_metrics
from trainer.model.lora import activate
from trainer.model.policy import collate, device_of, micro_batches, padded, to_device, token_logprobs
from trainer.offline.data import OfflineData, OfflineDataError
from trainer.rl.engines import push_weights, weight_sync
from trainer.rl.experience import broadcast
from trainer.rl.lifecycle import seed_all, wind_down, write_trained
from trainer.rl.oom import oom_explained
from trainer.rl.rollout import start_rollouts, validate
from trainer.rl.tracking import log_metrics, tracker_for
from trainer.rl.update import by_policy

log = logging.getLogger("harness.train")

_DISAGREE = 0.05  # mean |trainer - stored| logprob on step 1 above which pg warns: another model or temperature?


def train_offline(cfg: TrainConfig, mode: Mode) -> dict[str, float]:
    """Run `harness train --from-run` (mode from_run) or `harness sft` (mode sft); returns the last step's metrics."""
    placement = placement_of(cfg)  # checked at load: the GPUs of each rank (and of the validation engines)
    dist = init_distributed(gpus=placement.trainer_gpus if placement is not None else None)
    try:
        with oom_explained(cfg, dist.device):
            return _train(cfg, mode, dist)
    finally:
        shutdown()  # also when the data or a checkpoint is refused before the first step


def _train(cfg: TrainConfig, mode: Mode, dist: Dist) -> dict[str, float]:
    # ---------------------------------------------------------------------------------------------- setup
    t, o = cfg.trainer, cfg.offline
    seed_all(t.seed + dist.rank)
    out = run_dir(cfg)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg)
    data = broadcast(_samples_or_error(cfg, mode) if dist.is_main else None, dist)
    if isinstance(data, Exception):  # on every rank, so each ends with the same clear error
        raise data
    samples, advantages, policies = data.samples, data.advantages, data.policies
    _ignored(cfg)
    val_tasks = read_tasks(cfg.data.validation, split=cfg.data.validation_split,
                           limit=cfg.data.validation_limit) if cfg.data.validation else []
    plan = _batches(len(samples), o.batch_size, o.epochs, t.seed)
    total_steps = len(plan)
    adapters = adapters_of(cfg)  # several policies: one LoRA adapter each, each trained on its own samples
    fingerprint, this_model = _fingerprint(mode, data, cfg), model_fingerprint(cfg, adapters)
    checkpoint = find_resume(out, t.resume)
    if checkpoint is not None:  # before the model loads: a checkpoint of another run, model or data is refused
        check_resume(saved_state(checkpoint), checkpoint, mode, fingerprint, model=this_model,
                     experiment=cfg.experiment_name)
    built = build_policy(cfg, dist, total_steps, mode, adapters)  # offline: no reference, no critic
    model, optimizer, scheduler, pad_id = built.model, built.optimizer, built.scheduler, built.pad_id
    start = 0
    if checkpoint is not None:
        start = load(checkpoint, model, optimizer, scheduler, dist)["step"]
        log.info("resumed from %s: continuing with step %d of %d", checkpoint, start + 1, total_steps)

    rollouts = sync = tracker = store = None
    if dist.is_main:
        try:
            if val_tasks:  # the agent validates the trained weights on the engine
                rollouts = start_rollouts(cfg, out)
                sync = weight_sync(rollouts, cfg, out)
                tracker = tracker_for(rollouts.store, rollouts.run_id, cfg)
            else:  # metrics only
                store = Store.open(out / "harness.duckdb")
                run_id = f"{mode.replace('_', '-')}-{uuid.uuid4().hex[:12]}"
                store.start_run(run_id, {"command": mode, "model": cfg.model.path,
                                         "offline": config_to_dict(cfg)["offline"]}, harness.__version__)
                tracker = tracker_for(store, run_id, cfg)
        except duckdb.IOException as exc:  # another process (a proxy still recording?) holds the file
            raise OfflineDataError(f"can't write this run's metrics into {str(out / 'harness.duckdb')!r}: {exc}. "
                                   "Stop the process that holds it, or give this run another experiment_name (and "
                                   "--db for the recorded run)") from None
        log.info("%s: %d samples, %d steps (%d epochs of batches of %d), curve at %s", mode, len(samples),
                 total_steps, o.epochs, o.batch_size, out / "curve.png")
    if start > 0 and sync is not None:  # the engine serves the checkpoint's weights
        push_weights(model, sync, dist, version=start)
    if start == 0:
        before = {**data.metrics, **_data_nll_metrics(model, samples, policies, adapters, pad_id, cfg, dist)}
        if t.val_before_train and val_tasks:
            before.update(validate(rollouts, 0, val_tasks, cfg) if dist.is_main else {})
        log_metrics(tracker, 0, before)

    metrics: dict[str, float] = {}
    try:
        for step in range(start + 1, total_steps + 1):
            started = time.perf_counter()
            epoch, batch = plan[step - 1]
            # ------------------------------------------------ 1. one optimizer step over the batch, all ranks
            rows, advs = [samples[i] for i in batch], [advantages[i] for i in batch]
            if not adapters:
                metrics = _optimizer_step(model, optimizer, rows, advs, samples[0], pad_id, cfg, dist)
            else:  # each policy's samples through its adapter, with its own clipping and optimizer step
                metrics = {}
                for name, idx in by_policy(adapters, [policies[i] for i in batch]):
                    activate(model, name)
                    mine = _optimizer_step(model, optimizer, [rows[i] for i in idx], [advs[i] for i in idx],
                                           samples[0], pad_id, cfg, dist)
                    metrics.update({f"policy/{name}/{key}": value for key, value in mine.items()})
            scheduler.step()
            metrics.update({"actor/lr": scheduler.get_last_lr()[0], "offline/epoch": epoch + 1})
            disagree = max((v for k, v in metrics.items() if k.endswith("logprob/behaviour_mean_abs_diff")), default=0)
            if step == 1 and o.loss == "pg" and disagree > _DISAGREE:
                log.warning("the trainer's logprobs differ from the run's stored ones by %.3f on average before any "
                            "update: is model.path the model that sampled run %s, and rollout.temperature its "
                            "sampling temperature?", disagree, o.run)

            # ------------------------------------------------ 2. after an epoch: the NLL of all the data
            last = step == total_steps
            if last or plan[step][0] != epoch:
                metrics.update(_data_nll_metrics(model, samples, policies, adapters, pad_id, cfg, dist))

            # ------------------------------------------------ 3. validation with the agent, checkpoint, metrics
            if val_tasks and t.test_freq and (step % t.test_freq == 0 or last):
                metrics.update(push_weights(model, sync, dist, version=step))
                metrics.update(validate(rollouts, step, val_tasks, cfg) if dist.is_main else {})
            if (t.save_freq and step % t.save_freq == 0) or last:
                save(out, step, model, optimizer, scheduler, {"mode": mode, "model": this_model, "plan": fingerprint},
                     dist, keep_last=cfg.trainer.keep_checkpoints)
            metrics["time/step_s"] = time.perf_counter() - started
            log_metrics(tracker, step, metrics)
        write_trained(model, cfg, out, dist)
    finally:
        wind_down(tracker, rollouts)
        if store is not None:
            store.end_run(run_id)
            store.close()
    return metrics


# ---------------------------------------------------------------------------------------------- the parts


def _samples_or_error(cfg: TrainConfig, mode: Mode):
    """The samples (_samples), or the error that says why there are none."""
    from harness.running.tasks import TaskError
    from trainer.offline.chat_data import ChatDataError

    try:
        return _samples(cfg, mode)
    except (OfflineDataError, ChatDataError, TaskError) as exc:
        return exc


def check_data(cfg: TrainConfig, mode: Mode) -> str | None:
    """What is wrong with the offline data, or None: for the launcher of a multi-rank run, before the ranks start."""
    found = _samples_or_error(cfg, mode)
    return str(found) if isinstance(found, Exception) else None


def _fingerprint(mode: str, data: OfflineData, cfg: TrainConfig) -> str:
    """What a checkpoint must have been trained on to be continued: the samples (and the policy each trains),
    their order's seed and batching."""
    o = cfg.offline
    items = [mode, o.epochs, o.batch_size, cfg.trainer.seed, [(s.episode_id, s.token_ids) for s in data.samples]]
    if data.policies is not None:
        items.append(data.policies)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _ignored(cfg: TrainConfig) -> None:
    """Say which keys of an RL config offline training does not use, when they are set."""
    t = cfg.trainer
    unused = [name for name, value, default in (("trainer.total_steps", t.total_steps, None),
                                                  ("trainer.ppo_epochs", t.ppo_epochs, 1),
                                                  ("trainer.mini_batch_size", t.mini_batch_size, None),
                                                  ("trainer.tis_cap", t.tis_cap, None),
                                                  ("trainer.correction", t.correction, type(t.correction)()))
              if value != default]
    if unused:
        log.info("offline training does not use %s: offline.epochs and offline.batch_size decide the steps, and pg's "
                 "ratio is against the stored sampling logprobs", ", ".join(unused))


def _samples(cfg: TrainConfig, mode: Mode):
    """The samples to train and their advantages: a recorded run's, or chat records'."""
    if mode == "from_run":
        from trainer.offline.data import recorded_samples

        return recorded_samples(cfg)
    from transformers import AutoTokenizer

    from trainer.offline.chat_data import chat_samples, read_chat_records

    o = cfg.offline
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    chat = chat_samples(read_chat_records(o.data, split=o.split), tokenizer, max_length=o.max_length)
    if not chat.samples:
        raise OfflineDataError(f"offline.data {o.data!r}: none of its {chat.records} records gives a sample to train "
                               f"(left out: {chat.skipped}); see docs/training.md, Offline training")
    log.info("%s: %d records, %d samples%s", o.data, chat.records, len(chat.samples),
             f"; left out: {chat.skipped}" if chat.skipped else "")
    metrics = {"offline/records": chat.records, "offline/samples": len(chat.samples),
               "offline/split_per_turn": chat.split_per_turn,
               "offline/tokens_trained": sum(sum(s.loss_mask) for s in chat.samples),
               **{f"offline/skipped_{reason}": n for reason, n in chat.skipped.items()}}
    return OfflineData(chat.samples, [1.0] * len(chat.samples), metrics)


def _batches(n: int, batch_size: int, epochs: int, seed: int) -> list[tuple[int, list[int]]]:
    """(epoch, sample indices) of every step: each epoch a fresh shuffle (seeded) cut into batches."""
    plan = []
    for epoch in range(epochs):
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        plan += [(epoch, order[k:k + batch_size]) for k in range(0, n, batch_size)]
    return plan


def _optimizer_step(model, optimizer, rows: list[Sample], advantages: list[float], filler: Sample, pad_id: int,
                    cfg: TrainConfig, dist: Dist) -> dict[str, float]:
    """One optimizer step over `rows` (through the active adapter, with several policies: the AdamW moves only the
    parameters that have gradients): the gradient (_step), clipped, applied; its metrics and gradient norm."""
    t = cfg.trainer
    weights = algo.token_weights(rows, t.loss_agg_mode)
    metrics = _step(model, rows, advantages, weights, filler, pad_id, cfg, dist, cfg.offline.loss)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: DTensor
    return {**metrics, "actor/grad_norm": float(grad_norm)}


def _step(model, rows: list[Sample], advantages: list[float], weights: list[torch.Tensor], filler: Sample,
          pad_id: int, cfg: TrainConfig, dist: Dist, loss_kind: str) -> dict[str, float]:
    """Accumulate one batch's gradient over this rank's micro-batches; its metrics (summed over micro-batches as
    the weights make them: the batch's aggregate). Ranks run equally many passes (FSDP pairs collectives up); a
    rank with fewer runs `filler` with weight 0. Each micro-batch goes to the device in one copy (to_device); the
    metrics stay there until the last one, then the host reads them once."""
    t = cfg.trainer
    device = device_of(model)
    mine = list(range(dist.rank, len(rows), dist.world))
    groups = [[mine[j] for j in g] for g in micro_batches([rows[i] for i in mine], t.micro_batch_tokens, t.layout)
              ] if mine else []
    passes = most_over_ranks(len(groups), dist)
    temperature = cfg.rollout.temperature if loss_kind == "pg" else 1.0
    batch_tokens = max(sum(sum(r.loss_mask) for r in rows), 1)
    names = ["offline/nll"] if loss_kind == "sft" else ["actor/pg_loss", "logprob/behaviour_mean_abs_diff"]
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    policy = torch.zeros(len(algo.POLICY_METRICS), dtype=torch.float64, device=device)  # pg only
    computed = 0  # positions the forwards computed (trainer.layout decides)
    for n in range(passes):
        idx = groups[n] if n < len(groups) else None
        batch = collate([rows[i] for i in idx] if idx else [filler], pad_id, indices=idx, layout=t.layout)
        computed += batch.n_computed if idx else 0
        w = padded([weights[i] for i in idx], batch.loss_mask) if idx else torch.zeros_like(batch.loss_mask)
        adv = torch.tensor([advantages[i] for i in idx] if idx else [0.0]).unsqueeze(-1) * batch.loss_mask
        batch, w, adv = to_device(device, batch, w, adv)  # the one copy
        mask = batch.loss_mask
        logprobs, _ = token_logprobs(model, batch, temperature, loss_only=True,
                                     offload_activations=cfg.model.activation_offload)
        nll = -(logprobs * w).sum()
        if loss_kind == "pg":
            losses, log_ratio = algo.ppo_token_losses(logprobs, batch.engine_logprobs, adv, clip_low=t.clip_low,
                                                      clip_high=t.clip_high, dual_clip=t.dual_clip)
            loss = (losses * w).sum()
            share = batch.n_trained / batch_tokens if idx else 0.0  # of the whole batch, over all ranks
            diff = ((logprobs.detach() - batch.engine_logprobs).abs() * mask).sum().double() / batch_tokens if idx \
                else torch.zeros((), dtype=torch.float64, device=device)
            if idx:  # the filler's metrics are no part of the batch's
                values = algo.policy_metric_values(log_ratio, adv, mask, t.clip_low, t.clip_high, t.dual_clip)
                policy = algo.add_policy_metrics(policy, values, share)
            sums = sums + torch.stack([loss.detach().double(), diff])
        else:
            loss = nll
        (loss * dist.world).backward()  # FSDP averages gradients over ranks: undo it, the weights are global
        if loss_kind == "sft":  # (pg scores at rollout.temperature: offline/data_nll is its NLL at temperature 1)
            sums = sums + nll.detach().double().view(1)
    if loss_kind == "pg":
        names, sums = [*(f"actor/{key}" for key in algo.POLICY_METRICS), *names], torch.cat([policy, sums])
    stats = dict(zip(names, sums.tolist(), strict=True)) if passes else {}  # the one read
    stats = metrics_over_ranks(stats, 1.0, dist, summed=stats, maxed=("actor/ratio_max",))
    return {**stats, **computed_metrics(rows, computed, dist), "offline/tokens": float(batch_tokens)}


def _data_nll_metrics(model, samples: list[Sample], policies: list[str] | None, adapters: tuple[str, ...],
                      pad_id: int, cfg: TrainConfig, dist: Dist) -> dict[str, float]:
    """offline/data_nll over every sample; with several policies, each policy's samples through its adapter
    (policy/<name>/offline/data_nll), and their token-weighted mean as offline/data_nll."""
    if not adapters:
        return {"offline/data_nll": _data_nll(model, samples, pad_id, cfg, dist)}
    out, total, tokens = {}, 0.0, 0
    for name, idx in by_policy(adapters, policies):
        activate(model, name)
        mine = [samples[i] for i in idx]
        out[f"policy/{name}/offline/data_nll"] = nll = _data_nll(model, mine, pad_id, cfg, dist)
        count = sum(sum(s.loss_mask) for s in mine)
        total, tokens = total + nll * count, tokens + count
    return {**out, "offline/data_nll": total / max(tokens, 1)}


@torch.no_grad()
def _data_nll(model, samples: list[Sample], pad_id: int, cfg: TrainConfig, dist: Dist) -> float:
    """Mean NLL (temperature 1) over every trained token of `samples`, each rank scoring its share; the host
    counts the tokens and reads the sum once."""
    device = device_of(model)
    mine = list(range(dist.rank, len(samples), dist.world))
    nll, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    layout = cfg.trainer.layout
    groups = micro_batches([samples[i] for i in mine], cfg.trainer.micro_batch_tokens, layout) if mine else []
    for n in range(most_over_ranks(len(groups), dist)):
        idx = [mine[j] for j in groups[n]] if n < len(groups) else None
        (batch,) = to_device(device, collate([samples[i] for i in idx] if idx else [samples[0]], pad_id, indices=idx,
                                             layout=layout))
        logprobs, _ = token_logprobs(model, batch, 1.0, loss_only=True)
        if idx:
            nll, tokens = nll + (-(logprobs * batch.loss_mask).sum()).double(), tokens + batch.n_trained
    total = _all_reduce(torch.stack([nll.cpu(), torch.tensor(float(tokens), dtype=torch.float64)]), dist)
    return float(total[0] / total[1].clamp(min=1))


# ---------------------------------------------------------------------------------------------- small helpers


def _all_reduce(values: torch.Tensor, dist: Dist) -> torch.Tensor:
    if dist.world == 1:
        return values
    values = values.to(dist.device)
    torch.distributed.all_reduce(values)
    return values.cpu()


def _add(stats: dict[str, float], key: str, value: float) -> None:
    stats[key] = stats.get(key, 0.0) + value


