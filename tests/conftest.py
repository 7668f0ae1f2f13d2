"""Shared fixtures. The engine is started once per session: vLLM takes ~40 s to start on a 2-core CPU."""

from __future__ import annotations

import pytest

from harness.engine import start_vllm
from harness.tiny_model import build_tiny_model
from tests.support import ScriptedUpstream


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random Qwen2 chat model (seed 0), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def engine(tiny_model_dir, tmp_path_factory):
    """A real vLLM serving the tiny model; tests using it carry @pytest.mark.engine."""
    with start_vllm(tiny_model_dir, tmp_path_factory.mktemp("engine")) as running:
        yield running


@pytest.fixture
def upstream():
    """The scripted engine (a real HTTP server answering like vLLM), for tests that control the engine's bytes."""
    up = ScriptedUpstream()
    yield up
    up.close()
