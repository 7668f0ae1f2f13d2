"""The model a run trains, built in one place. `build_policy` loads the policy, puts LoRA's adapter on it, shards it
over the ranks, gives it its optimizer and learning rate schedule, then loads what the RL loop scores with beside
it: the frozen reference (trainer.kl_coef > 0) and the critic (adv_estimator: gae). The RL loop
(trainer/rl/loop.py) and offline training (trainer/offline/loop.py) both start here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.maths.schedule import lr_factor
from trainer.model.critic import Critic
from trainer.model.fsdp import Dist, shard
from trainer.model.lora import LoraSpec, adapter_parameters, spec_of, with_adapter, with_adapters
from trainer.model.policy import load_policy

if TYPE_CHECKING:
    from trainer.config import Mode, TrainConfig

__all__ = ["BuiltPolicy", "build_policy", "dtype_of", "pad_id_of"]


@dataclass(frozen=True)
class BuiltPolicy:
    """What a run trains and scores with."""

    model: torch.nn.Module  # the policy sharded over the ranks; with LoRA base + adapter, only the adapter trains
    optimizer: torch.optim.Optimizer  # AdamW over exactly the parameters that train
    scheduler: torch.optim.lr_scheduler.LambdaLR  # the learning rate over the run's steps
    lora: LoraSpec | None  # the adapter's spec (trainer.lora); None when the whole model trains
    reference: torch.nn.Module | None  # the initial policy, sharded, in eval mode, never optimised; rl with kl_coef > 0
    critic: Critic | None  # the value model with its own optimizer; rl with adv_estimator: gae
    pad_id: int  # the tokenizer's padding id (its eos id when it has none)
    adapters: tuple[str, ...] = ()  # with several policies (roles.policies), their adapters' names; () with one


def build_policy(cfg: TrainConfig, dist: Dist, total_steps: int, mode: Mode = "rl",
                 adapters: Sequence[str] = ()) -> BuiltPolicy:
    """The policy of `cfg` on this rank: loaded, with LoRA, sharded, with its AdamW and its schedule over
    `total_steps`; in mode rl also the reference and the critic when the config asks for them (offline training,
    modes from_run and sft, uses neither). `adapters`: with several policies (trainer.config.checks adapters_of),
    one LoRA adapter each over the one base."""
    t = cfg.trainer
    offload = t.fsdp.param_offload or t.fsdp.optimizer_offload  # FSDP2 offloads parameters and optimizer state together
    policy = load_policy(cfg.model.path, dtype_of(cfg), cfg.model.gradient_checkpointing,
                         trust_remote_code=cfg.model.trust_remote_code)
    lora = spec_of(t.lora)
    adapters = tuple(adapters)
    if adapters and lora is None:
        raise ValueError(f"adapters {list(adapters)!r} need trainer.lora.rank > 0")
    if adapters:  # one adapter per policy over the one frozen base
        policy = with_adapters(policy, lora, adapters)
    elif lora is not None:  # adapters train, the base stays frozen; the engine serves base + adapter
        policy = with_adapter(policy, lora)
    model = shard(policy, dist, mixed_precision=t.fsdp.mixed_precision, param_offload=offload)
    # one AdamW, a parameter group per adapter: a step moves only the parameters that have gradients (the active
    # adapter's), so each adapter keeps moments and step counts of its own
    groups = [{"params": adapter_parameters(model, name)} for name in adapters] or \
        [{"params": [p for p in model.parameters() if p.requires_grad]}]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    if adapters:
        _zero_moments(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t.warmup_steps, t.lr_schedule, total_steps))

    reference = None
    if mode == "rl" and t.kl_coef > 0:  # the initial policy, frozen
        reference = shard(load_policy(cfg.model.path, dtype_of(cfg), trust_remote_code=cfg.model.trust_remote_code),
                          dist, param_offload=offload).eval()
    pad_id = pad_id_of(cfg.model.path, cfg.model.trust_remote_code)
    critic = Critic(cfg, dist, total_steps) if mode == "rl" and t.adv_estimator == "gae" else None
    return BuiltPolicy(model, optimizer, scheduler, lora, reference, critic, pad_id, adapters)


def _zero_moments(optimizer: torch.optim.AdamW) -> None:
    """AdamW's state for every parameter now, as its first step would make it (step 0, zero moments): an adapter
    that has not trained yet then has state to save and load like the others. Without it, loading a checkpoint
    gives such an adapter a state made by a step of torch's own (torch.distributed.checkpoint fills missing
    optimizer state so), and the resumed run would count one step more for it than the uninterrupted one."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def dtype_of(cfg: TrainConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype,
                                                                                                 torch.float32)


def pad_id_of(model_dir: str | Path, trust_remote_code: bool) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0
