"""The critic of `adv_estimator: gae`: a value model on the policy's architecture, its own optimiser, and its update.

The value model is the policy's checkpoint with the output layer replaced by a one-output head (zero-initialised,
so the first values are 0 and GAE starts as Monte Carlo returns): it is sharded, checkpointed and run exactly as
the policy is (trainer/model/fsdp.py finds the decoder layers, the decoder and the head). values[b, t] is the value of
the state in which token t was sampled: the head's output at position t - 1, as token t's logprob comes from the
logits there (trainer/model/policy.py).

Each step (trainer/rl/loop.py): values of the step's samples before any update -> GAE advantages and returns
(trainer/maths/estimators.py) -> the actor's update -> `ppo_epochs` passes of the critic over the same mini-batches,
with the clipped value loss aggregated as trainer.loss_agg_mode says. For the first `critic.warmup_steps` steps only
the critic learns (the policy's update is skipped), so the advantages it gives later are worth following.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness.core.records import Sample
from trainer.maths.algorithms import token_weights
from trainer.maths.estimators import value_token_losses
from trainer.maths.schedule import lr_factor
from trainer.model.checkpoint import CHECKPOINTS, load, save
from trainer.model.fsdp import Dist, metrics_over_ranks, most_over_ranks, shard
from trainer.model.policy import activations, collate, load_policy, micro_batches, padded

if TYPE_CHECKING:
    from trainer.config import TrainConfig

__all__ = ["Critic"]


class Critic:
    """The value model with its AdamW and schedule (trainer.critic), sharded like the policy."""

    def __init__(self, cfg: TrainConfig, dist: Dist, total_steps: int):
        t, c = cfg.trainer, cfg.trainer.critic
        model = load_policy(c.model_path or cfg.model.path, torch.float32, cfg.model.gradient_checkpointing,
                            trust_remote_code=cfg.model.trust_remote_code)
        hidden = model.get_output_embeddings().weight.shape[1]
        head = torch.nn.Linear(hidden, 1, bias=True)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        model.config.tie_word_embeddings = False
        model.set_output_embeddings(head)
        self.model = shard(model, dist, mixed_precision=t.fsdp.mixed_precision,
                           param_offload=t.fsdp.param_offload or t.fsdp.optimizer_offload)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=tuple(t.betas),
                                           weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_factor(0, t.lr_schedule, total_steps))
        self.cfg, self.dist = cfg, dist

    def _values(self, batch) -> torch.Tensor:
        """[B, T] values aligned with the tokens, on the batch's device; 0 at position 0 and outside the loss mask."""
        home, batch = batch.token_ids.device, batch.to(next(self.model.parameters()).device)
        with activations(self.cfg.model.activation_offload and torch.is_grad_enabled()):
            out = self.model(input_ids=batch.token_ids, attention_mask=batch.attention_mask, use_cache=False)
        values = out.logits[..., 0].float()
        shifted = torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)
        return torch.where(batch.loss_mask > 0, shifted, 0.0).to(home)

    @torch.no_grad()
    def values(self, rows: list[Sample], pad_id: int) -> list[torch.Tensor]:
        """Each row's values [len(row)] at the current weights."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        for idx in micro_batches(rows, self.cfg.trainer.micro_batch_tokens) if rows else []:
            values = self._values(collate([rows[i] for i in idx], pad_id, indices=idx))
            for row, i in enumerate(idx):
                out[i] = values[row, :len(rows[i].token_ids)]
        return out

    def update(self, rows: list[Sample], tasks_of_rows: list[str], returns: list[torch.Tensor],
               old_values: list[torch.Tensor], pad_id: int) -> dict[str, float]:
        """`ppo_epochs` passes over the rows in the actor's mini-batches (whole tasks), one optimizer step each;
        the critic's metrics averaged over them."""
        t, dist = self.cfg.trainer, self.dist
        n_mini = max(1, self.cfg.rollout.batch_size // (t.mini_batch_size or self.cfg.rollout.batch_size))
        tasks, rng = list(dict.fromkeys(tasks_of_rows)), random.Random(t.seed + 1)
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(t.ppo_epochs if rows else 0):
            rng.shuffle(tasks)
            for k in range(min(n_mini, len(tasks))):
                chosen = set(tasks[k::n_mini])
                mini = [i for i, task in enumerate(tasks_of_rows) if task in chosen]
                weights = token_weights([rows[i] for i in mini], t.loss_agg_mode)
                mine = list(range(dist.rank, len(mini), dist.world))
                stats = self._accumulate([rows[mini[j]] for j in mine], [returns[mini[j]] for j in mine],
                                         [old_values[mini[j]] for j in mine], [weights[j] for j in mine],
                                         rows[0], pad_id)
                stats = metrics_over_ranks(stats, sum(sum(rows[mini[j]].loss_mask) for j in mine), dist,
                                           ("critic/vf_loss",))
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                stats["critic/grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps += 1
        self.scheduler.step()
        out = {key: value / steps for key, value in sums.items()} if steps else {}
        return {**out, "critic/lr": self.scheduler.get_last_lr()[0]}

    def _accumulate(self, rows, returns, old_values, weights, filler: Sample, pad_id: int) -> dict[str, float]:
        """This rank's share of one mini-batch: the weighted clipped value loss, backward per micro-batch (a rank
        with fewer micro-batches runs `filler` with weight 0, so FSDP's collectives pair up)."""
        t, dist = self.cfg.trainer, self.dist
        groups = micro_batches(rows, t.micro_batch_tokens) if rows else []
        passes = most_over_ranks(len(groups), dist)
        stats = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/abs_error": 0.0}
        total = max(sum(sum(r.loss_mask) for r in rows), 1)
        for n in range(passes):
            idx = groups[n] if n < len(groups) else []
            batch = collate([rows[i] for i in idx] if idx else [filler], pad_id, indices=idx or None)
            mask = batch.loss_mask
            w, old, ret = (padded([xs[i] for i in idx], mask) for xs in (weights, old_values, returns))
            values = self._values(batch)
            per_token, clipped = value_token_losses(values, old, ret, t.critic.cliprange_value)
            loss = (per_token * w).sum()
            (loss * dist.world).backward()  # FSDP averages gradients over ranks: the weights are global
            valid = mask > 0
            stats["critic/vf_loss"] += loss.item()
            stats["critic/vf_clipfrac"] += float(torch.where(valid, clipped.float(), 0.0).sum()) / total
            stats["critic/abs_error"] += float(torch.where(valid, (values.detach() - ret).abs(), 0.0).sum()) / total
        return stats


    def save(self, out: Path, step: int, keep_last: int | None = None) -> None:
        """Beside the policy's checkpoint: <run dir>/critic/checkpoints/step_<step>/ (a collective), as many kept."""
        save(out / "critic", step, self.model, self.optimizer, self.scheduler, {}, self.dist, keep_last=keep_last)

    def load(self, policy_checkpoint: Path) -> None:
        """The critic saved with the policy checkpoint `policy_checkpoint` (<run dir>/checkpoints/step_<k>)."""
        path = Path(policy_checkpoint).parent.parent / "critic" / CHECKPOINTS / Path(policy_checkpoint).name
        if not path.is_dir():
            raise FileNotFoundError(f"the checkpoint {str(policy_checkpoint)!r} has no critic beside it ({path}): "
                                    "it was not saved by an adv_estimator gae run; start fresh with trainer.resume "
                                    "disable")
        load(path, self.model, self.optimizer, self.scheduler, self.dist)
