"""A model directory with a real model's shape and no weights, for memory plans on paper: a config.json with the
shape, and a safetensors file whose header names every tensor of a Qwen2 decoder of that shape (what
`count_parameters` and `lora_parameters` read) while its data is a sparse hole of the right length (nothing is
written to disk, and safetensors opens it). The tokenizer and chat template are the tiny model's, so the reply
parsers can be built on it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from harness.running.gpus import Shape

QWEN25_1_5B = {  # Qwen/Qwen2.5-1.5B-Instruct's config.json, the keys the shape and the loaders read
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "hidden_act": "silu",
}


def shaped_model(out: Path, config: dict, tokenizer_from: Path | None = None) -> Path:
    """Write `out`: `config` as config.json, a header-only bf16 model.safetensors with a Qwen2 decoder's tensors
    of that shape (q/k/v biases, tied embeddings when the config says so), the tokenizer files of `tokenizer_from`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], h], "model.norm.weight": [h]}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = [config["vocab_size"], h]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": [h, h], p + "self_attn.q_proj.bias": [h],
                   p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.k_proj.bias": [kv],
                   p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.v_proj.bias": [kv],
                   p + "self_attn.o_proj.weight": [h, h], p + "mlp.gate_proj.weight": [i, h],
                   p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
                   p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)  # the data: a hole, no bytes on disk
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if tokenizer_from is not None and (Path(tokenizer_from) / name).is_file():
            shutil.copy(Path(tokenizer_from) / name, out / name)
    return out


def shape_parameters(config: dict) -> int:
    """The parameters `shaped_model` writes for `config`: the shape's own estimate."""
    return Shape.from_config("model", config).parameters


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
