"""LoRA: the policy trains low-rank adapters (peft) over frozen base weights, and the engine serves base + adapter.

The engine is started with LoRA on (`engine_args`, `ENGINE_ENV`: runtime adapter loading) and serves the adapted
policy under `ADAPTER_NAME`; the recording proxy sends every call there. A push writes only the adapter
(`adapter_config.json` + `adapter_model.safetensors`, peft's format, which vLLM reads) into a new directory per
version and swaps the engine onto it (trainer/model/weight_sync.py, adapter mode): unload the name, load it from the new
directory. A request in flight keeps the adapter it started with, so every call is sampled by exactly the weight
version it is recorded with. Unlike `load_inplace`, nothing is re-read from disk while generating.

What vLLM takes (vllm/lora, 0.32): target modules among the attention and MLP projections (it packs q/k/v and
gate/up itself), no embeddings or output layer, no DoRA, bias "none"; the engine's `--max-lora-rank` must be one
of VLLM_RANKS, at least the adapter's rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ADAPTER_NAME", "ENGINE_ENV", "LoraSpec", "activate", "adapter_parameters", "adapters_in_use",
           "engine_args", "spec_of", "with_adapter", "with_adapters"]

ADAPTER_NAME = "policy-lora"  # the model name the engine serves base + adapter under
ENGINE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}  # /v1/load_lora_adapter and /v1/unload_lora_adapter
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        if not 1 <= self.rank <= VLLM_RANKS[-1]:
            raise ValueError(f"LoRA rank {self.rank!r} must be from 1 to {VLLM_RANKS[-1]} (vLLM's largest)")
        if self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA alpha {self.alpha!r} must be positive and dropout {self.dropout!r} in [0, 1)")
        unknown = sorted(set(self.target_modules) - set(TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"LoRA target_modules {list(self.target_modules)!r}: vLLM serves adapters on "
                             f"{', '.join(TARGETS)} only; {unknown or 'none given'} cannot be served")


def spec_of(lora) -> LoraSpec | None:
    """The spec of the config's trainer.lora section (trainer/config/keys.py LoraConfig); None when rank is 0."""
    return LoraSpec(lora.rank, lora.alpha, tuple(lora.target_modules), lora.dropout) if lora.rank > 0 else None


def adapters_in_use(max_staleness: int) -> int:
    """How many adapter versions calls may still be generating on: the newest, the one before (calls started before
    the push), and with asynchronous rollouts K versions more."""
    return 2 + max_staleness


def engine_args(spec: LoraSpec, loaded: int = 2) -> list[str]:
    """vLLM flags for serving adapters of `spec`'s rank; `loaded` at once, so calls that started on an older
    version finish on it while new ones use the new (2; K + 2 with asynchronous rollouts K versions ahead)."""
    max_rank = next(r for r in VLLM_RANKS if r >= spec.rank)
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", str(loaded), "--max-cpu-loras",
            str(loaded)]


def with_adapter(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """`model` with a fresh adapter (its B matrices zero: at first it computes exactly what `model` does); only
    the adapter's parameters require gradients."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                        lora_dropout=spec.dropout, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def with_adapters(model: torch.nn.Module, spec: LoraSpec, names: Sequence[str]) -> torch.nn.Module:
    """`model` with one fresh adapter of `spec` per name (one per policy: roles.policies), each zero at first, the
    first one active. Every adapter's parameters require gradients, always: a forward through the active adapter
    gives only its parameters gradients (the others' stay None, which AdamW and FSDP2 skip), so nothing about
    what trains changes after the model is sharded."""
    from peft import LoraConfig, get_peft_model

    if len(set(names)) != len(names) or not names:
        raise ValueError(f"adapter names {list(names)!r} must be distinct, and at least one")
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                        lora_dropout=spec.dropout, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config)
    activate(peft_model, names[0])
    return peft_model


def activate(model: torch.nn.Module, name: str) -> None:
    """Compute with adapter `name` from now on (a model of `with_adapters`, also sharded). peft's set_adapter marks
    only the active adapter trainable; every adapter is made trainable again, as with_adapters keeps them."""
    model.base_model.set_adapter(name)
    for key, parameter in model.named_parameters():
        if ".lora_" in key:
            parameter.requires_grad_(True)


def adapter_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """The parameters of adapter `name` (peft names them `...lora_A.<name>.weight`), in the model's order."""
    found = [p for key, p in model.named_parameters()
             if any(f".{part}.{name}." in key for part in ("lora_A", "lora_B"))]
    if not found:
        raise ValueError(f"the model has no adapter {name!r}")
    return found


def save_adapter(model: torch.nn.Module, out: Path, state_dict: dict | None = None, name: str | None = None) -> int:
    """Write the adapter of a peft model into `out` (vLLM's format); the bytes of its weights. `state_dict`: the
    model's full state (e.g. gathered from FSDP shards), when its own parameters are not whole tensors. `name`: which
    adapter of a model with several (with_adapters); None: its only one."""
    if not hasattr(model, "peft_config"):
        raise ValueError(f"pushing an adapter needs a peft model (trainer/model/lora.py with_adapter), got "
                         f"{type(model).__name__}")
    if name is None:
        model.save_pretrained(out, state_dict=state_dict, save_embedding_layers=False)
    else:  # peft writes an adapter not named "default" into a folder of its name: vLLM reads it from `out`
        model.save_pretrained(out, state_dict=state_dict, save_embedding_layers=False, selected_adapters=[name])
        if name != "default":
            for file in (out / name).iterdir():
                file.rename(out / file.name)
            (out / name).rmdir()
    return (out / "adapter_model.safetensors").stat().st_size


