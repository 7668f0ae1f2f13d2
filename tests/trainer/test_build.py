"""The model's front door (trainer/model/build.py): build_policy on the tiny model, in one rank on the CPU, for full
weights, for LoRA, and with the reference and the critic an RL run asks for; offline training gets neither."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from trainer.config import load_config
from trainer.model.build import BuiltPolicy, build_policy
from trainer.model.critic import Critic
from trainer.model.lora import LoraSpec

ROOT = Path(__file__).resolve().parents[2]


def _built(model_dir: Path, dist, *overrides: str, mode: str = "rl") -> BuiltPolicy:
    cfg = load_config(ROOT / "examples/train/terse.yaml", [f"model.path={model_dir}", *overrides])
    return build_policy(cfg, dist, total_steps=10, mode=mode)


def _ids(params) -> set[int]:
    return {id(p) for p in params}


def _optimised(built: BuiltPolicy) -> set[int]:
    return _ids(p for group in built.optimizer.param_groups for p in group["params"])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor under FSDP


def test_full_weights_train_every_parameter_and_pad_with_the_tokenizer_s_pad(tiny_model_dir, one_rank):
    built = _built(tiny_model_dir, one_rank, "trainer.lr=3e-4")
    params = list(built.model.parameters())
    assert built.lora is None and built.reference is None and built.critic is None
    assert all(p.requires_grad for p in params)
    assert _optimised(built) == _ids(params)
    assert built.optimizer.param_groups[0]["lr"] == built.scheduler.get_last_lr()[0]  # the schedule drives AdamW
    assert built.scheduler.base_lrs == [3e-4]
    pad = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("<|endoftext|>")
    assert built.pad_id == pad != AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id


def test_lora_trains_only_the_adapter_and_leaves_the_base_frozen(tiny_model_dir, one_rank):
    built = _built(tiny_model_dir, one_rank, "trainer.lora.rank=4", "trainer.lora.alpha=8")
    assert built.lora == LoraSpec(4, 8.0, built.lora.target_modules, built.lora.dropout)
    named = dict(built.model.named_parameters())
    adapter = {name for name in named if "lora_" in name}
    assert adapter and len(adapter) < len(named)
    assert {name for name, p in named.items() if p.requires_grad} == adapter  # the base stays frozen
    assert _optimised(built) == _ids(named[name] for name in adapter)


def test_rl_with_kl_and_gae_gets_a_frozen_separate_reference_and_a_critic(tiny_model_dir, one_rank):
    built = _built(tiny_model_dir, one_rank, "trainer.kl_coef=0.1", "trainer.adv_estimator=gae")
    reference = built.reference
    assert reference is not None and reference is not built.model and not reference.training
    assert not _ids(reference.parameters()) & _optimised(built)  # never optimised
    policy, initial = dict(built.model.named_parameters()), dict(reference.named_parameters())
    assert policy.keys() == initial.keys()
    for name, p in policy.items():  # the same weights in memory of its own
        assert torch.equal(_full(p.detach()), _full(initial[name].detach()))
        assert _full(p).data_ptr() != _full(initial[name]).data_ptr()

    assert isinstance(built.critic, Critic)
    assert built.critic.optimizer is not built.optimizer
    assert not _ids(built.critic.model.parameters()) & (_optimised(built) | _ids(reference.parameters()))


def test_offline_training_gets_no_reference_and_no_critic(tiny_model_dir, one_rank):
    built = _built(tiny_model_dir, one_rank, "trainer.kl_coef=0.1", "trainer.adv_estimator=gae", mode="sft")
    assert built.reference is None and built.critic is None
    assert _optimised(built) == _ids(built.model.parameters())
