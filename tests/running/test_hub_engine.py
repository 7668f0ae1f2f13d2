"""A model given by Hugging Face id, served by a real vLLM: the id is found in the local cache (the tiny model's
files, cached as huggingface_hub lays out a download), and the engine starts offline on the snapshot directory,
serving the model under its id, with the engine arguments `--engine-args` gives (`harness serve` and `run`)."""

from __future__ import annotations

import pytest

from harness.running.engine_args import check_engine_args, split_engine_args
from harness.running.vllm_server import start_or_attach
from tests.running.hub_cache import cache_model


def test_an_engine_started_on_a_cached_hub_id_serves_its_snapshot_under_the_id(tiny_model_dir, tmp_path, monkeypatch):
    openai = pytest.importorskip("openai")
    snapshot = cache_model(tmp_path / "hf-cache", "org/tiny-qwen2", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    extra = check_engine_args(split_engine_args(["--max-num-seqs 3"]), "--engine-args")
    with start_or_attach(model="org/tiny-qwen2", upstream=None, run_dir=tmp_path / "run", max_model_len=512,
                         extra_args=extra) as engine:
        assert engine.served_model == "org/tiny-qwen2"
        client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="org/tiny-qwen2", max_tokens=3,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
    log = (tmp_path / "run" / "engine.log").read_text()
    assert str(snapshot) in log  # vLLM was given the directory, not the id
    given = [line for line in log.splitlines() if "non-default args" in line]  # vLLM's own list of what it was given
    assert given and "'max_num_seqs': 3" in given[0] and "'max_model_len': 512" in given[0], given
