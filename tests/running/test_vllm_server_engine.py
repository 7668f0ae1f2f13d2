"""The engine seam against a real vLLM: start, serve token ids, attach, and fail with a readable error."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from harness.running.vllm_server import EngineError, attach, start_vllm


def test_engine_lists_its_model(engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [engine.served_model]


def test_engines_share_vllm_s_cache_so_a_start_finds_the_model_class_inspected(engine):
    """vLLM inspects a model class in a subprocess that imports every model (~15-30 s of CPU here) unless its cache
    (VLLM_CACHE_ROOT) holds the answer: the engines keep it in one place, not one per run directory."""
    cached = Path(os.environ["VLLM_CACHE_ROOT"]) / "modelinfos"
    assert [p.name for p in cached.glob("*Qwen2ForCausalLM.json")], sorted(p.name for p in cached.glob("*"))
    assert not (engine.log_path.parent / "vllm-cache").exists()


def test_chat_returns_prompt_and_completion_token_ids_with_logprobs(engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    response = client.chat.completions.create(
        model=engine.served_model,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=5,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    raw = response.model_dump()
    choice = raw["choices"][0]
    assert raw["prompt_token_ids"] and all(isinstance(i, int) for i in raw["prompt_token_ids"])
    assert len(raw["prompt_token_ids"]) == raw["usage"]["prompt_tokens"]
    assert 1 <= len(choice["token_ids"]) == len(choice["logprobs"]["content"]) <= 5


def test_chat_with_tools_goes_through_the_hermes_parser(engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    response = client.chat.completions.create(
        model=engine.served_model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        max_tokens=4,
    )
    assert response.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_attach_to_running_engine_reads_model_and_token_id_support(engine):
    attached = attach(engine.base_url + "/v1/")
    assert attached.base_url == engine.base_url
    assert attached.served_model == engine.served_model
    assert attached.returns_token_ids is True
    attached.stop()  # no-op: attach owns no process


def test_attach_to_closed_port_names_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        with pytest.raises(EngineError, match=f"127.0.0.1:{port}"):
            attach(f"http://127.0.0.1:{port}", timeout_s=2)


def test_start_on_empty_model_dir_fails_with_log_tail(tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    started = time.monotonic()
    with pytest.raises(EngineError, match="engine.log") as failure:
        start_vllm(empty, tmp_path / "run", ready_timeout_s=120)
    assert "exited with code" in str(failure.value)
    assert time.monotonic() - started < 120
    assert (tmp_path / "run" / "engine.log").stat().st_size > 0
