"""A model given by Hugging Face id or by path (harness/running/hub.py): the rule that tells them apart, the
local cache (written in tmp_path as huggingface_hub lays it out, tests/running/hub_cache.py), and the one-line
errors. No test reaches the network: offline is HF_HUB_OFFLINE=1, and "the Hub" is a local server or a closed port.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness.running.hub import (
    ModelNotFoundError,
    hub_cache,
    hub_id_of,
    is_hub_id,
    model_name,
    model_reference,
    resolve_model,
)
from tests.running.hub_cache import COMMIT, cache_model

huggingface_hub = pytest.importorskip("huggingface_hub")

QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
CONFIG = {"config.json": b'{"model_type": "qwen2"}', "tokenizer_config.json": b"{}"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache that HF_HUB_CACHE points at, set after huggingface_hub was imported (it must be read at
    the call), and offline mode off unless a test turns it on."""
    folder = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return folder


@pytest.fixture
def hub(monkeypatch):
    """Where huggingface_hub looks for the Hub: `hub.set(url)` sends it to a local server or a closed port (the
    edge, faked; the rest of huggingface_hub runs as it is)."""

    class Hub:
        def set(self, url: str) -> None:
            monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)

    return Hub()


# ---------------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(("given", "expected"), [
    (QWEN, QWEN),  # shaped like org/name and not a folder here: a Hub id, kept as written
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("./Qwen/Qwen2.5-1.5B-Instruct", "{base}/Qwen/Qwen2.5-1.5B-Instruct"),  # ./ makes it a path
    ("runs/tiny/hf", "{base}/runs/tiny/hf"),  # two slashes: no Hub id has them
    ("tiny", "{base}/tiny"),  # no slash: a folder here (the Hub's old bare names are not taken)
    ("../models/x", "{parent}/models/x"),
    ("/abs/org/name", "/abs/org/name"),
    ("org--x/name", "{base}/org--x/name"),  # "--" is not allowed in an id
    ("org/name.git", "{base}/org/name.git"),
    ("-org/name", "{base}/-org/name"),
])  # fmt: skip
def test_a_reference_is_a_path_unless_it_is_shaped_like_a_hub_id_and_not_there(tmp_path, given, expected):
    assert model_reference(given, tmp_path) == expected.format(base=tmp_path, parent=tmp_path.parent)


def test_a_local_directory_shadows_the_hub_id_of_the_same_name(tmp_path):
    (tmp_path / "Qwen" / "Qwen2.5-1.5B-Instruct").mkdir(parents=True)
    assert model_reference(QWEN, tmp_path) == str(tmp_path / QWEN)


def test_a_home_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_reference("~/org/name", "/elsewhere") == str(tmp_path / "org" / "name")


def test_hub_ids_follow_the_hubs_own_validation():
    """Our shape check (no huggingface_hub import when a config is parsed) agrees with validate_repo_id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    for value in [QWEN, "a/b", "a.b/c_d-e", "org/name.git", "org--x/y", "a/.b", "a/b-", "a" * 96 + "/b",
                  "a" * 97 + "/b", "-a/b", "a/b/c", "a b/c", "a/b..c"]:
        try:
            validate_repo_id(value)
            valid = "/" in value
        except HFValidationError:
            valid = False
        assert is_hub_id(value) == valid, value


# ---------------------------------------------------------------------------------------------- the cache


def test_a_cached_hub_id_resolves_to_its_snapshot_directory(cache, tmp_path, monkeypatch):
    snapshot = cache_model(cache, QWEN, CONFIG)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache is enough: no network wanted
    assert resolve_model(QWEN) == snapshot
    assert (snapshot / "config.json").read_bytes() == CONFIG["config.json"]  # through the blob symlink
    assert hub_id_of(snapshot) == QWEN and model_name(snapshot) == QWEN  # served by id, not by commit hash
    assert model_name(tmp_path / "runs" / "tiny") == "tiny" and hub_id_of(tmp_path) is None


def test_the_cache_is_found_where_huggingface_hub_puts_it(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", "~/hub-cache")
    assert hub_cache() == tmp_path / "hub-cache"


def test_a_model_under_hf_home_resolves_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache_model(tmp_path / "hf" / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", CONFIG, commit="f" * 40)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == snapshot


# ---------------------------------------------------------------------------------------------- what is refused


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def test_an_uncached_hub_id_offline_names_the_id_and_the_command_that_fetches_it(cache, monkeypatch):
    cache_model(cache, "other/model", CONFIG)  # a cache that holds something else
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(QWEN, "model.path")
    text = _one_line(exc)
    assert text.startswith(f"model.path {QWEN!r} is not a local directory, nor in the Hugging Face cache")
    assert str(cache) in text and "HF_HUB_OFFLINE is set" in text and f"`hf download {QWEN}`" in text
    with pytest.raises(ModelNotFoundError, match=r"^--model 'org/name' is no folder in '/data', nor in the Hugging"):
        resolve_model("org/name", looked_in="/data")  # where model_reference looked for it as a path


def test_an_interrupted_download_offline_is_named_as_partly_cached(cache, monkeypatch):
    """huggingface_hub keeps the file list of a download it began (trees/<commit>.json); a snapshot that lacks some
    of them is not taken for the model (vLLM would fail on it later, or load half of it)."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")  # huggingface_hub 1.x and later
    snapshot = cache_model(cache, QWEN, CONFIG)
    entries = {name: tree_cache.TreeCacheEntry(size=len(data), blob_id="0" * 40) for name, data in
               {**CONFIG, "model.safetensors": b"weights"}.items()}
    tree_cache.write_tree_cache(str(snapshot.parent.parent), COMMIT, entries)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(QWEN)
    assert _one_line(exc) == (f"--model {QWEN!r} is only partly in the Hugging Face cache ({snapshot}: its download "
                              f"was interrupted), and HF_HUB_OFFLINE is set: complete it with `hf download {QWEN}` on "
                              "a machine that is online (or unset HF_HUB_OFFLINE)")
    (snapshot / "model.safetensors").write_bytes(b"weights")  # the rest arrives: the model is there
    assert resolve_model(QWEN) == snapshot


def test_an_uncached_hub_id_without_network_says_the_download_failed_and_how_to_fetch_it(cache, hub):
    with socket.socket() as s:  # a port nothing listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hub.set(f"http://127.0.0.1:{port}")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(QWEN)
    text = _one_line(exc)
    assert "downloading it failed (ConnectError" in text and f"`hf download {QWEN}`" in text
    assert not list(cache.glob("models--*/snapshots/*"))  # nothing half-made is taken for the model


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """The Hub's answer for a model it does not have (or may not show): 404 with X-Error-Code RepoNotFound."""

    def do_GET(self):
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_a_hub_id_the_hub_does_not_have_is_named_with_what_to_do(cache, hub):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub.set(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(ModelNotFoundError) as exc:
            resolve_model("runs/tiyn", "model.path")  # a mistyped folder is shaped like an id too
    finally:
        server.shutdown()
        server.server_close()
    text = _one_line(exc)
    assert text.startswith("model.path 'runs/tiyn' is not a local directory") and "the Hub has no such model" in text


def test_a_missing_directory_is_an_error_and_is_not_taken_for_a_hub_id(tmp_path, cache):
    reference = model_reference("./runs/tiny", tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(reference)
    assert _one_line(exc) == (f"--model {str(tmp_path / 'runs' / 'tiny')!r} is not a directory: give a model "
                              "directory (build a tiny one with `harness tiny-model DIR`) or a Hugging Face id such "
                              "as Qwen/Qwen2.5-1.5B-Instruct")
    with pytest.raises(ModelNotFoundError, match=r"'nowhere' is not a directory \(looked for '/.*/nowhere'\)"):
        resolve_model("nowhere")  # relative: from the current directory


def test_a_directory_without_config_json_is_refused(tmp_path, cache):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(str(tmp_path / "weights"))
    assert "has no config.json: give a Hugging Face model directory" in _one_line(exc)
    snapshot = cache_model(cache, "org/no-config", {"model.safetensors": b"x"})
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("org/no-config")
    assert _one_line(exc).startswith(f"--model 'org/no-config ({snapshot})' has no config.json")


# ---------------------------------------------------------------------------------------------- the CLI


def _harness(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=cwd)


def test_serve_with_an_uncached_hub_id_offline_exits_2_with_the_fetch_command(tmp_path):
    done = _harness("serve", "--model", QWEN, "--run-dir", str(tmp_path / "runs"), cwd=tmp_path,
                    env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty")})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: --model {QWEN!r} is no folder in {str(tmp_path)!r}, nor in the Hugging Face "
                               f"cache {str(tmp_path / 'empty')!r}")
    assert f"`hf download {QWEN}`" in lines[0]


def test_retokenize_takes_a_cached_hub_id_as_its_model(tiny_model_dir, tmp_path):
    """--model by id reaches the snapshot: here the tiny model's files, cached as org/tiny, tokenise an empty
    database (nothing to do, but its tokenizer was found and loaded)."""
    from harness.store.database import Store

    cache_model(tmp_path / "hf-cache", "org/tiny", tiny_model_dir)
    db = tmp_path / "harness.duckdb"
    Store.open(db).close()
    done = _harness("retokenize", "--model", "org/tiny", "--db", str(db),
                    env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache")})
    assert done.returncode == 0, done.stderr
    assert f"with {tmp_path / 'hf-cache' / 'models--org--tiny' / 'snapshots' / COMMIT}" in done.stderr
