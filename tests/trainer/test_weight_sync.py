"""Weight sync: atomic weights directories, the engine's pause / reload / reset / resume sequence against a scripted
engine (exact control over failures), and against the real vLLM: after a push the engine's greedy output is
transformers' greedy output of the new weights, and the proxy records the pushed version on later calls.
The tests on the real engine are in test_weight_sync_engine.py."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from tests.support import BackgroundApp  # noqa: E402
from trainer.model.weight_sync import WeightSync, WeightSyncError  # noqa: E402

# --- a scripted engine: the dev routes only, answering what each test says -------------------------------------------


class DevRoutes:
    """vLLM's weight-update routes; records every call; `answers` maps a route to (status, JSON body)."""

    def __init__(self, answers: dict[str, tuple[int, dict]] | None = None):
        self.answers = answers or {}
        self.calls: list[tuple[str, str, dict]] = []
        app = web.Application()
        for route in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"):
            app.router.add_post(route, self.handle)
        self.served = BackgroundApp(app)
        self.url = self.served.url

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.calls.append((request.path, request.query_string, body))
        status, answer = self.answers.get(request.path, (200, {"success": True}))
        return web.json_response(answer, status=status)

    def close(self):
        self.served.close()


@pytest.fixture
def dev_routes():
    routes = DevRoutes()
    yield routes
    routes.close()


def _model(tiny_model_dir):
    from trainer.model.policy import load_policy

    return load_policy(tiny_model_dir)


def test_push_writes_a_complete_dir_then_pauses_reloads_resets_and_resumes(dev_routes, tiny_model_dir, tmp_path):
    sync = WeightSync(dev_routes.url, tmp_path / "weights", model_dir=tiny_model_dir)
    timings = sync.push(_model(tiny_model_dir), version=3)
    weights_dir = tmp_path / "weights" / "v000003"
    assert [(path, query) for path, query, _ in dev_routes.calls] == [
        ("/pause", "mode=keep"), ("/collective_rpc", ""), ("/reset_prefix_cache", "reset_running_requests=true"),
        ("/resume", "")]
    assert dev_routes.calls[1][2] == {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in weights_dir.iterdir()}
    assert json.loads((weights_dir / "config.json").read_text())["tie_word_embeddings"] is False
    assert set(timings) == {"write_s", "pause_s", "reload_s", "reset_s", "notify_s", "resume_s", "total_s", "bytes"}
    assert timings["total_s"] >= timings["write_s"] + timings["reload_s"] and timings["bytes"] > 1e6
    assert not list((tmp_path / "weights").glob(".tmp-*"))


def test_pushes_keep_the_newest_dirs_and_a_failed_write_leaves_nothing(dev_routes, tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    import safetensors.torch

    state = _model(tiny_model_dir).state_dict()
    sync = WeightSync(dev_routes.url, tmp_path / "w", model_dir=tiny_model_dir, keep=2)
    for version in (1, 2, 10):
        sync.push(state, version)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v000002", "v000010"]

    def crash(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        sync.push(state, 11)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v000002", "v000010"]
    assert len(dev_routes.calls) == 3 * 4  # the failed write never reached the engine


def test_a_failed_reload_names_the_url_and_dev_mode_and_still_resumes(tiny_model_dir, tmp_path):
    routes = DevRoutes({"/collective_rpc": (404, {"detail": "Not Found"})})
    try:
        sync = WeightSync(routes.url, tmp_path / "w", model_dir=tiny_model_dir)
        with pytest.raises(WeightSyncError, match=rf"{routes.url}/collective_rpc answered HTTP 404.*"
                                                  "VLLM_SERVER_DEV_MODE=1"):
            sync.push(_model(tiny_model_dir), 1)
        assert [path for path, _, _ in routes.calls] == ["/pause", "/collective_rpc", "/resume"]
    finally:
        routes.close()


def test_an_engine_without_pause_reloads_without_it(tiny_model_dir, tmp_path):
    routes = DevRoutes({"/pause": (404, {"detail": "Not Found"})})
    try:
        sync = WeightSync(routes.url, tmp_path / "w", model_dir=tiny_model_dir)
        model = _model(tiny_model_dir)
        sync.push(model, 1)
        sync.push(model, 2)  # asked once
        assert [path for path, _, _ in routes.calls] == ["/pause", "/collective_rpc", "/reset_prefix_cache",
                                                         "/collective_rpc", "/reset_prefix_cache"]
        assert sync.can_pause is False
    finally:
        routes.close()


def test_unreachable_engine_and_a_tied_engine_config_are_named(dev_routes, tiny_model_dir, tmp_path):
    model = _model(tiny_model_dir)
    with pytest.raises(WeightSyncError, match=r"POST http://127.0.0.1:9/pause\?mode=keep failed.*Connection refused"):
        WeightSync("http://127.0.0.1:9/v1", tmp_path / "a", model_dir=tiny_model_dir, timeout_s=5).push(model, 1)
    model.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        WeightSync(dev_routes.url, tmp_path / "b").push(model, 1)
    state = dict(model.state_dict(), **{"lm_head.weight": model.model.embed_tokens.weight})
    with pytest.raises(ValueError, match="needs model_dir"):
        WeightSync(dev_routes.url, tmp_path / "d").push(state, 1)
    assert dev_routes.calls == []


def test_a_tied_state_is_written_with_its_output_layer_as_its_own_tensor(tiny_model_dir, tmp_path):
    """The trainer keeps a tied model tied; the untied engine (trainer/model/tied.py) gets the output layer written out,
    equal to the trained embeddings, whether the state shares the tensor or leaves it out."""
    import torch
    from safetensors.torch import load_file

    model = _model(tiny_model_dir)
    embeddings = model.model.embed_tokens.weight
    shared = dict(model.state_dict(), **{"lm_head.weight": embeddings})
    left_out = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sync = WeightSync("http://127.0.0.1:9", tmp_path / "w", model_dir=tiny_model_dir)
    for version, state in enumerate((shared, left_out), start=1):
        weights_dir, _ = sync.write(state, version)
        written = load_file(weights_dir / "model.safetensors")
        assert torch.equal(written["lm_head.weight"], embeddings.detach())
        assert torch.equal(written["model.embed_tokens.weight"], embeddings.detach())


# --- the real engine (engine tier) -----------------------------------------------------------------------------------
