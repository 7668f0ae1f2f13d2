"""The step's update in `harness train`'s RL loop (trainer/rl/loop.py): the old and reference logprobs scored over
the step's samples (per policy with several), then `ppo_epochs` x mini-batches x micro-batches of the policy loss,
each rank on its share (`_share`), short ranks padded with a filler pass so FSDP's collectives meet."""

from __future__ import annotations

import logging
import random

import torch

from harness.core.records import Sample
from trainer.config import TrainConfig
from trainer.config.checks import correction_of
from trainer.maths import algorithms as algo
from trainer.model.fsdp import Dist, metrics_over_ranks, most_over_ranks
from trainer.model.layout import computed_metrics
from trainer.model.lora import activate
from trainer.model.policy import collate, device_of, micro_batches, padded, to_device, token_logprobs
from trainer.rl.correction import bypass_keys, bypass_measures

log = logging.getLogger("harness.train")


def by_policy(adapters: tuple[str, ...], policies: list[str]) -> list[tuple[str, list[int]]]:
    """Each policy (adapter) that has samples, with the positions of its samples in `policies` (each sample's)."""
    out = [(name, [i for i, p in enumerate(policies) if p == name]) for name in adapters]
    return [(name, idx) for name, idx in out if idx]


def score(model, reference, experience, adapters: tuple[str, ...], pad_id: int, cfg: TrainConfig):
    """`score_rows` over the step's samples; with several policies each policy's samples through its adapter, and
    the engine agreement per policy too."""
    rows = experience.samples
    if not adapters:
        return score_rows(model, reference, rows, pad_id, cfg)
    old: list[torch.Tensor | None] = [None] * len(rows)
    ref: list[torch.Tensor | None] = [None] * len(rows)
    metrics: dict[str, float | None] = {}
    worst, total, count = None, 0.0, 0
    for name, idx in by_policy(adapters, experience.policies):
        activate(model, name)
        mine_old, mine_ref, diff = score_rows(model, reference, [rows[i] for i in idx], pad_id, cfg)
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
def score_rows(model, reference, rows: list[Sample], pad_id: int, cfg: TrainConfig):
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


def update_policies(model, optimizer, adapters: tuple[str, ...], policies: list[str] | None, rows, tasks_of_rows,
                     advantages, old, ref, pad_id: int, cfg: TrainConfig, dist: Dist, is_weights=None) -> dict:
    """`update` over the rows; with several policies, over each policy's rows through its adapter in turn, with its
    own gradient clipping and optimizer steps (the AdamW moves only the parameters that have gradients: the
    active adapter's), metrics under `policy/<name>/`. A policy without rows this step is left as it was."""
    if not adapters:
        return update(model, optimizer, rows, tasks_of_rows, advantages, old, ref, pad_id, cfg, dist, is_weights)
    metrics: dict[str, float] = {}
    weighted: dict[str, float] = {}
    tokens = computed = 0.0
    for name, idx in by_policy(adapters, policies):
        activate(model, name)
        mine = update(model, optimizer, [rows[i] for i in idx], [tasks_of_rows[i] for i in idx],
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


def update(model, optimizer, rows, tasks_of_rows, advantages, old, ref, pad_id: int, cfg: TrainConfig,
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
            stats, positions = mini_batch(model, [rows[mini[j]] for j in mine], [advantages[mini[j]] for j in mine],
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


def mini_batch(model, rows, advantages, old, ref, weights, filler: Sample, pad_id: int, cfg: TrainConfig,
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


