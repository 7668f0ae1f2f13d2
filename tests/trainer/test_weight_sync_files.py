"""What a push writes (trainer/model/weight_sync.py write, trainer/model/files.py write_weights): full weights in the
engine's dtype, in shards with the index transformers writes, the output layer of a tied model written out, the
same files from the FSDP-sharded model (one rank, and two ranks under torchrun) as from its plain state dict; a LoRA
push as before. No engine: `write` alone; the reload of such a directory by the real vLLM is in
test_weight_sync_engine.py."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.model.weight_sync import WeightSync, engine_dtype

ROOT = Path(__file__).resolve().parents[2]
NOWHERE = "http://127.0.0.1:9"  # write() never reaches the engine
SMALL_SHARDS = 400_000  # bytes: the tiny model (0.82M parameters) in several shards in any dtype


def _model(model_dir):
    from trainer.model.policy import load_policy

    return load_policy(model_dir)


def _written(weights_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(weights_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _dtypes(weights_dir: Path) -> set[str]:
    found = set()
    for shard in weights_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            found |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    return found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_push_is_written_in_the_engine_dtype_in_shards_that_transformers_loads(tiny_model_dir, tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    model = _model(tiny_model_dir)
    sync = WeightSync(NOWHERE, tmp_path / "w", model_dir=tiny_model_dir, dtype=dtype, max_shard_bytes=SMALL_SHARDS)
    weights_dir, written = sync.write(model, 4)

    shards = sorted(p.name for p in weights_dir.glob("*.safetensors"))
    assert len(shards) > 2 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                          for i in range(1, len(shards) + 1)]
    assert written == sum((weights_dir / s).stat().st_size for s in shards)
    assert all((weights_dir / s).stat().st_size <= SMALL_SHARDS + 4096 or len(load_file(weights_dir / s)) == 1
               for s in shards)  # a shard over the limit holds one tensor larger than it
    assert _dtypes(weights_dir) == {{torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]}

    cast = {k: v.to(dtype) for k, v in model.state_dict().items()}
    index = json.loads((weights_dir / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"} and set(index["weight_map"]) == set(cast)
    assert index["metadata"] == {"total_parameters": sum(v.numel() for v in cast.values()),
                                 "total_size": sum(v.numel() * v.element_size() for v in cast.values())}
    assert set(index["weight_map"].values()) == set(shards)
    assert all(k in load_file(weights_dir / s) for k, s in index["weight_map"].items())

    reloaded = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype).state_dict()
    assert reloaded.keys() == cast.keys()
    assert all(torch.equal(reloaded[k], cast[k]) for k in cast)


def test_a_push_within_one_shard_is_one_file_and_the_trained_dtype_by_default(tiny_model_dir, tmp_path):
    state = _model(tiny_model_dir).state_dict()
    weights_dir, _ = WeightSync(NOWHERE, tmp_path / "w", model_dir=tiny_model_dir).write(state, 1)
    assert sorted(p.name for p in weights_dir.glob("model*")) == ["model.safetensors"]
    written = load_file(weights_dir / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in state.items())


def test_a_tied_state_is_written_untied_in_the_engine_dtype_in_shards(tiny_model_dir, tmp_path):
    """trainer/model/tied.py: the engine serves a tied model untied; the output layer is written out as the trained
    embeddings, cast, whether the state shares the tensor or leaves it out."""
    model = _model(tiny_model_dir)
    embeddings = model.model.embed_tokens.weight.detach()
    shared = dict(model.state_dict(), **{"lm_head.weight": embeddings})
    left_out = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sync = WeightSync(NOWHERE, tmp_path / "w", model_dir=tiny_model_dir, dtype=torch.bfloat16,
                      max_shard_bytes=SMALL_SHARDS)
    for version, state in enumerate((shared, left_out), start=1):
        weights_dir, _ = sync.write(state, version)
        written = _written(weights_dir)
        assert torch.equal(written["lm_head.weight"], embeddings.to(torch.bfloat16))
        assert torch.equal(written["model.embed_tokens.weight"], embeddings.to(torch.bfloat16))


def test_the_sharded_model_is_written_as_its_plain_state_dict(one_rank, tied_model, tmp_path):
    """Pushing the FSDP-sharded model gathers one tensor at a time into the same files as the full state dict;
    here a tied one (FSDP2 keeps the tie one parameter, written out twice)."""
    from trainer.model.fsdp import full_state_dict, shard

    model = shard(_model(tied_model), one_rank)
    _untied_config(tied_model, tmp_path / "untied")
    sync = WeightSync(NOWHERE, tmp_path / "w", model_dir=tmp_path / "untied", dtype=torch.bfloat16,
                      max_shard_bytes=SMALL_SHARDS)
    from_model, _ = sync.write(model, 1)
    from_state, _ = sync.write(full_state_dict(model, one_rank), 2)
    assert sorted(p.name for p in from_model.iterdir()) == sorted(p.name for p in from_state.iterdir())
    for shard_file in from_model.glob("*.safetensors"):
        assert shard_file.read_bytes() == (from_state / shard_file.name).read_bytes()
    assert "lm_head.weight" in _written(from_model)


def _untied_config(model_dir: Path, out: Path) -> None:
    """The config files of the untied view an engine serves (trainer/model/tied.py engine_view), without its weights."""
    out.mkdir()
    for item in model_dir.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors"):
            (out / item.name).write_bytes(item.read_bytes())
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))


WORKER = textwrap.dedent(
    '''
    import sys

    import torch

    from trainer.model.fsdp import init_distributed, shard, shutdown
    from trainer.model.policy import load_policy
    from trainer.model.weight_sync import WeightSync, follow_push

    model_dir, config_dir, out = sys.argv[1:4]
    dist = init_distributed(device="cpu")
    model = shard(load_policy(model_dir), dist)
    if dist.is_main:
        WeightSync("http://127.0.0.1:9", out, model_dir=config_dir, dtype=torch.bfloat16,
                   max_shard_bytes=400_000).write(model, 7)
    else:
        follow_push(model)
    torch.distributed.barrier()
    shutdown()
    '''
)


def test_two_ranks_push_the_sharded_model_tensor_by_tensor(tied_model, tmp_path, monkeypatch):
    """On two ranks (torchrun, gloo) the main rank writes while the other follows the gathers: the files hold the
    whole model, cast, as one process would write it."""
    from trainer.model.fsdp import launch

    _untied_config(tied_model, tmp_path / "untied")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    assert launch(2, [str(script), str(tied_model), str(tmp_path / "untied"), str(tmp_path / "w")]) == 0
    written = _written(tmp_path / "w" / "v000007")
    state = _model(tied_model).state_dict()
    assert written.keys() == state.keys() | {"lm_head.weight"}
    assert all(torch.equal(written[k], state[k].to(torch.bfloat16)) for k in state)


def test_a_lora_push_writes_the_adapter_as_before_whatever_the_engine_dtype(tiny_model_dir, tmp_path):
    from trainer.model.lora import LoraSpec, save_adapter, with_adapter

    model = with_adapter(_model(tiny_model_dir), LoraSpec(rank=4, target_modules=("q_proj",)))
    save_adapter(model, tmp_path / "direct", None)
    sync = WeightSync(NOWHERE, tmp_path / "w", adapter="policy", dtype=torch.bfloat16, max_shard_bytes=1000)
    weights_dir, written = sync.write(model, 1)
    assert sorted(p.name for p in weights_dir.iterdir()) == sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert (weights_dir / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "direct" / "adapter_model.safetensors").read_bytes()
    assert written == (weights_dir / "adapter_model.safetensors").stat().st_size


# --- the engine's dtype ------------------------------------------------------------------------------------------


def _config_dir(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    return folder


def test_engine_dtype_is_what_vllm_serves_as_harness_starts_it(tmp_path):
    bf16 = _config_dir(tmp_path, torch_dtype="bfloat16")
    assert engine_dtype(bf16, gpu=False) == torch.float32  # start_vllm's CPU recipe: --dtype float32
    assert engine_dtype(bf16, gpu=True) == torch.bfloat16  # vLLM's auto: the config's dtype
    assert engine_dtype(bf16, ["--dtype", "half"], gpu=True) == torch.float16
    assert engine_dtype(bf16, ["--dtype=float32", "--max-num-seqs", "8"], gpu=True) == torch.float32
    assert engine_dtype(bf16, ["--dtype", "float16", "--dtype", "auto"], gpu=False) == torch.bfloat16  # last wins
    assert engine_dtype(_config_dir(tmp_path, dtype="float16"), gpu=True) == torch.float16
    assert engine_dtype(_config_dir(tmp_path, text_config={"dtype": "float16"}), gpu=True) == torch.float16
    assert engine_dtype(_config_dir(tmp_path, torch_dtype="float32"), gpu=True) == torch.bfloat16  # downcast
    assert engine_dtype(_config_dir(tmp_path), gpu=True) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype 'fp8' is not one of vLLM's: auto, half"):
        engine_dtype(bf16, ["--dtype", "fp8"], gpu=True)
