"""trainer/model/tied.py: a model that ties its embeddings is served untied: the engine's view of it, and what a push
writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trainer.model.tied import as_shipped, engine_view, ties_embeddings


def test_ties_embeddings_reads_the_config_as_transformers_does(tmp_path, tiny_model_dir, tied_model):
    assert ties_embeddings(tied_model) and not ties_embeddings(tiny_model_dir)
    for model_type, ties in (("llama", False), ("qwen2", False), ("gemma", True), ("gpt2", True), ("custom", True)):
        unsaid = tmp_path / model_type  # a config.json that does not say: its architecture's default in transformers
        unsaid.mkdir()
        (unsaid / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert ties_embeddings(unsaid) is ties, model_type  # custom: a type transformers does not know
    assert not ties_embeddings(tmp_path / "no-such-model")


def test_the_engine_view_writes_the_output_layer_out_and_unties_the_config(tied_model, tmp_path):
    shipped = load_file(tied_model / "model.safetensors")
    assert "lm_head.weight" not in shipped
    view = engine_view(tied_model, tmp_path / "run" / "engine-model")
    assert json.loads((view / "config.json").read_text())["tie_word_embeddings"] is False
    written = load_file(view / "model.safetensors")
    assert torch.equal(written["lm_head.weight"], shipped["model.embed_tokens.weight"])
    assert all(torch.equal(written[k], v) for k, v in shipped.items())
    assert (view / "tokenizer.json").read_bytes() == (tied_model / "tokenizer.json").read_bytes()
    served = AutoModelForCausalLM.from_pretrained(view, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(served(ids).logits, trained(ids).logits)
    engine_view(tied_model, view)  # rebuilt in place, whole
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["engine-model"]


def test_a_model_without_safetensors_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    with pytest.raises(FileNotFoundError, match=r"'.*m' has no \.safetensors weights"):
        engine_view(tmp_path / "m", tmp_path / "view")
    assert not (tmp_path / "view").exists()


def test_a_tied_models_weights_are_written_as_shipped_without_the_output_layer(tied_model, tiny_model_dir):
    """save_hf leaves the output layer out where the config ties it and it is the embeddings (transformers and vLLM
    tie it back on load); an untied config, or an output layer that differs, keeps it."""
    emb = torch.randn(4, 3)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone(), "model.norm.weight": torch.ones(3)}
    assert sorted(as_shipped(state, tied_model)) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert as_shipped(state, tiny_model_dir) is state
    differs = {**state, "lm_head.weight": emb + 1}
    assert as_shipped(differs, tied_model) is differs


def _with_config(model_dir, out, **changes):
    """A copy of the model at `model_dir` in `out` whose config.json has `changes`."""
    import shutil

    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_a_config_whose_tie_flag_disagrees_with_the_weights_is_named(tied_model, tiny_model_dir, tmp_path):
    from trainer.model.tied import tie_disagreement

    assert tie_disagreement(tied_model) is None and tie_disagreement(tiny_model_dir) is None
    # Saved tied (no output layer in the weights), config untied: transformers would make a random output layer.
    untied_flag = _with_config(tied_model, tmp_path / "untied-flag", tie_word_embeddings=False)
    assert "hold no 'lm_head.weight'" in tie_disagreement(untied_flag)
    assert "tie_word_embeddings: true" in tie_disagreement(untied_flag)
    # Trained untied (an output layer of its own), config tied: transformers would drop that output layer.
    tied_flag = _with_config(tiny_model_dir, tmp_path / "tied-flag", tie_word_embeddings=True)
    assert "differs from them" in tie_disagreement(tied_flag)
    assert "tie_word_embeddings: false" in tie_disagreement(tied_flag)


def test_harness_train_refuses_a_tie_flag_that_disagrees_when_the_config_loads(tied_model, tmp_path):
    from pathlib import Path

    from trainer.config import ConfigError, load_config

    bad = _with_config(tied_model, tmp_path / "untied-flag", tie_word_embeddings=False)
    config = Path(__file__).resolve().parents[2] / "examples" / "train" / "terse.yaml"
    with pytest.raises(ConfigError, match=r"^model\.path .*untied-flag.*: .*hold no 'lm_head\.weight'") as refused:
        load_config(config, [f"model.path={bad}", "trainer.lora.rank=8"])  # with LoRA too: the base itself is wrong
    assert "\n" not in str(refused.value)
