"""The model a run trains, built in one place. `build_policy` loads the policy, puts LoRA's adapter on it, shards it
over the ranks, gives it its optimizer and learning rate schedule, then loads what the RL loop scores with beside
it: the frozen reference (trainer.kl_coef > 0) and the critic (adv_estimator: gae). The RL loop
(trainer/rl/loop.py) and offline training (trainer/offline/loop.py) both start here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.maths.schedule import lr_factor
from trainer.model.critic import Critic
from trainer.model.fsdp import Dist, shard
from trainer.model.lora import LoraSpec, spec_of, with_adapter
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


def build_policy(cfg: TrainConfig, dist: Dist, total_steps: int, mode: Mode = "rl") -> BuiltPolicy:
    """The policy of `cfg` on this rank: loaded, with LoRA, sharded, with its AdamW and its schedule over
    `total_steps`; in mode rl also the reference and the critic when the config asks for them (offline training,
    modes from_run and sft, uses neither)."""
    t = cfg.trainer
    offload = t.fsdp.param_offload or t.fsdp.optimizer_offload  # FSDP2 offloads parameters and optimizer state together
    policy = load_policy(cfg.model.path, dtype_of(cfg), cfg.model.gradient_checkpointing,
                         trust_remote_code=cfg.model.trust_remote_code)
    lora = spec_of(t.lora)
    if lora is not None:  # adapters train, the base stays frozen; the engine serves base + adapter
        policy = with_adapter(policy, lora)
    model = shard(policy, dist, mixed_precision=t.fsdp.mixed_precision, param_offload=offload)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t.warmup_steps, t.lr_schedule, total_steps))

    reference = None
    if mode == "rl" and t.kl_coef > 0:  # the initial policy, frozen
        reference = shard(load_policy(cfg.model.path, dtype_of(cfg), trust_remote_code=cfg.model.trust_remote_code),
                          dist, param_offload=offload).eval()
    pad_id = pad_id_of(cfg.model.path, cfg.model.trust_remote_code)
    critic = Critic(cfg, dist, total_steps) if mode == "rl" and t.adv_estimator == "gae" else None
    return BuiltPolicy(model, optimizer, scheduler, lora, reference, critic, pad_id)


def dtype_of(cfg: TrainConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype,
                                                                                                 torch.float32)


def pad_id_of(model_dir: str | Path, trust_remote_code: bool) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0
