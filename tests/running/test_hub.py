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
from tests.running.hub_cache import COMMIT, NO_TENSORS, cache_model

huggingface_hub = pytest.importorskip("huggingface_hub")

QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
CONFIG = {"config.json": b'{"model_type": "qwen2"}', "tokenizer_config.json": b"{}"}
MODEL = {**CONFIG, "model.safetensors": NO_TENSORS}  # what a full use takes for a model: a config and weights


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
    snapshot = cache_model(cache, QWEN, MODEL)
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
    snapshot = cache_model(tmp_path / "hf" / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", MODEL, commit="f" * 40)
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
    shards = {f"model-0000{i}-of-00002.safetensors": NO_TENSORS for i in (1, 2)}
    snapshot = cache_model(cache, QWEN, {**CONFIG, "model-00001-of-00002.safetensors": NO_TENSORS})
    entries = {name: tree_cache.TreeCacheEntry(size=len(data), blob_id="0" * 40) for name, data in
               {**CONFIG, **shards}.items()}
    tree_cache.write_tree_cache(str(snapshot.parent.parent), COMMIT, entries)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(QWEN)
    assert _one_line(exc) == (f"--model {QWEN!r} is only partly in the Hugging Face cache ({snapshot}: its download "
                              f"was interrupted), and HF_HUB_OFFLINE is set: complete it with `hf download {QWEN}` on "
                              "a machine that is online (or unset HF_HUB_OFFLINE)")
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(NO_TENSORS)  # the rest arrives: the model is there
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


# ---------------------------------------------------------------------------------------------- part of a model
# A use that reads only a tokenizer (harness doctor) or a config fetches only those files (`files`); a full use is
# not fooled by the snapshot without weights that this leaves in the cache. "The Hub" is a real server on
# 127.0.0.1 (tests/running/hub_server.py) that HF_ENDPOINT points a subprocess at: huggingface_hub reads it at
# import, and the download code runs as it is.

TOKENIZER_FILES = {"chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json"}  # the tiny model's files that a tokenizer is read from

_FETCH = """import sys
from harness.running.hub import ModelNotFoundError, local_model
try:
    print(local_model(sys.argv[1], files=sys.argv[2]))
except ModelNotFoundError as exc:
    sys.exit(f"error: {exc}")
"""


@pytest.fixture
def fake_hub(tiny_model_dir):
    """The Hub with one repository, org/tiny: the tiny model's files and a README (weights: model.safetensors)."""
    from tests.running.hub_server import FakeHub

    with FakeHub() as hub:
        hub.add("org/tiny", {**{p.name: p.read_bytes() for p in tiny_model_dir.iterdir()}, "README.md": b"# tiny"})
        yield hub


def _fetch(hub, cache: Path, files: str, offline: bool = False, repo_id: str = "org/tiny"):
    """`local_model(repo_id, files=files)` in a fresh interpreter whose HF_ENDPOINT is the fake Hub."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1" if offline else "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("TRANSFORMERS_OFFLINE", None)
    return subprocess.run([sys.executable, "-c", _FETCH, repo_id, files], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cache.parent)


def test_a_tokenizer_only_fetch_downloads_no_weights_and_its_tokenizer_loads(fake_hub, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    done = _fetch(fake_hub, tmp_path / "hf-cache", "tokenizer")
    assert done.returncode == 0, done.stderr
    assert sorted(fake_hub.downloads("org/tiny")) == sorted(TOKENIZER_FILES)  # no weights, no README
    snapshot = Path(done.stdout.strip())
    assert snapshot == tmp_path / "hf-cache" / "models--org--tiny" / "snapshots" / COMMIT
    messages = [{"role": "user", "content": "hi"}]
    fetched, built = AutoTokenizer.from_pretrained(snapshot), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert fetched.apply_chat_template(messages) == built.apply_chat_template(messages)
    assert "'s tokenizer files from the Hugging Face Hub" in done.stderr

    done = _fetch(fake_hub, tmp_path / "other-cache", "config")  # a model's shape: its two configs only
    assert done.returncode == 0, done.stderr
    assert sorted(fake_hub.downloads("org/tiny")[len(TOKENIZER_FILES):]) == ["config.json", "generation_config.json"]


def test_after_a_tokenizer_only_fetch_a_full_use_offline_says_the_weights_are_missing_and_online_fetches_them(
        fake_hub, tmp_path):
    cache = tmp_path / "hf-cache"
    assert _fetch(fake_hub, cache, "tokenizer").returncode == 0
    snapshot = cache / "models--org--tiny" / "snapshots" / COMMIT
    done = _fetch(fake_hub, cache, "tokenizer", offline=True)  # the tokenizer is cached: no network wanted
    assert done.returncode == 0 and done.stdout.strip() == str(snapshot), done.stderr

    done = _fetch(fake_hub, cache, "all", offline=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0] == (f"error: --model 'org/tiny' is in the Hugging Face cache without its weights ({snapshot} "
                        "holds only some of its files, such as its tokenizer), and HF_HUB_OFFLINE is set: fetch it "
                        "with `hf download org/tiny` on a machine that is online (or unset HF_HUB_OFFLINE)")

    done = _fetch(fake_hub, cache, "all")
    assert done.returncode == 0 and done.stdout.strip() == str(snapshot), done.stderr
    assert sorted(fake_hub.downloads("org/tiny")[len(TOKENIZER_FILES):]) == ["README.md", "model.safetensors"]
    assert (snapshot / "model.safetensors").read_bytes() == fake_hub.repos["org/tiny"]["model.safetensors"]


def test_a_snapshot_without_weights_or_a_file_list_is_not_taken_for_the_model(fake_hub, tiny_model_dir, tmp_path,
                                                                               cache, monkeypatch):
    """A tokenizer fetched file by file (transformers' AutoTokenizer given an id, or huggingface_hub before 1.0)
    leaves a snapshot with no list of the repository's files: the weights are looked for in the snapshot itself."""
    snapshot = cache_model(cache, "org/tiny", {name: (tiny_model_dir / name).read_bytes() for name in TOKENIZER_FILES})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny", files="tokenizer") == snapshot
    assert resolve_model("org/tiny", files="config") == snapshot
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("org/tiny")
    assert _one_line(exc).startswith(f"--model 'org/tiny' is in the Hugging Face cache without its weights ({snapshot}")

    done = _fetch(fake_hub, cache, "all")  # online: the weights are fetched into the same snapshot
    assert done.returncode == 0 and done.stdout.strip() == str(snapshot), done.stderr
    assert "model.safetensors" in fake_hub.downloads("org/tiny")
    assert not TOKENIZER_FILES & set(fake_hub.downloads("org/tiny"))  # what is cached is not fetched again


def test_a_sharded_model_missing_a_shard_is_only_partly_cached(cache, monkeypatch):
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    snapshot = cache_model(cache, QWEN, {**CONFIG, "model.safetensors.index.json": index,
                                         "model-00001-of-00002.safetensors": NO_TENSORS})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(QWEN)
    assert _one_line(exc).startswith(f"--model {QWEN!r} is only partly in the Hugging Face cache ({snapshot}: its "
                                     "download was interrupted)")
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(NO_TENSORS)
    assert resolve_model(QWEN) == snapshot


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match="files 'weights' is none of 'all', 'tokenizer', 'config'"):
        resolve_model(QWEN, files="weights")
