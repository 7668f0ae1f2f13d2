"""A model named by a directory or by a Hugging Face id, made into the local directory everything else loads.

`harness serve --model`, `harness run --model`, `harness export --model` and the config key `model.path` all take
either. One rule tells them apart (`model_reference`): a value that exists, is absolute, or starts with `.` or `~` is
a path; otherwise a value shaped like a Hub id (`org/name`, one slash, the Hub's characters) is an id; anything
else is a path. A path that is not a model directory is an error here, never handed on to vLLM or transformers
(which would read `org/name` under the wrong folder and fail with "Repo id must be in the form ...").

An id is looked up in the local Hugging Face cache first (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub, read when called, not when huggingface_hub was imported), so a cached model starts with
no network at all; only a model that is not cached is downloaded, and offline (HF_HUB_OFFLINE=1, or no network) the
error names the command that fetches it. The engine is then started on the snapshot directory, never on the id.

A use that needs only part of a model asks for that part (`files`): "tokenizer" (what a tokenizer and its chat
template are read from: `harness doctor`, retokenizing) or "config" (a model's shape), so no weights are fetched
for it. The cache then holds a snapshot of that commit without weights, and so may a tokenizer that transformers or
vLLM fetched by id: a full use ("all") takes a cached snapshot only when its weights are there, and otherwise fetches
them (offline, it says so and names the command).

huggingface_hub comes with transformers and vLLM, not with the core install: it is imported only for an id.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Literal

from harness import install_hint

__all__ = ["ModelFiles", "ModelNotFoundError", "hub_cache", "hub_id_of", "is_hub_id", "local_model", "model_name",
           "model_reference", "resolve_model"]

ModelFiles = Literal["all", "tokenizer", "config"]
"""Which files of a Hub model a use needs: "all" (to serve or train it), "tokenizer" (its tokenizer, chat template
and configs), "config" (config.json and generation_config.json: its shape)."""

# The Hub's own rule (huggingface_hub.utils.validate_repo_id) for org/name: letters, digits, -, _ and .; neither
# part starts or ends with - or .; no -- or ..; at most 96 characters each.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^{_PART}/{_PART}$")
_TRUE = ("1", "ON", "YES", "TRUE")
# Files no loader here reads, left out of a download: other frameworks' weights, and Meta's original checkpoints
# that some repositories ship beside the transformers ones (as large again).
_IGNORED = ["*.gguf", "*.onnx", "onnx/*", "*.msgpack", "*.h5", "*.tflite", "*.ot", "coreml/*", "original/*"]
_CONFIG = ["config.json", "generation_config.json"]
# Every file transformers' AutoTokenizer reads (tokenization_utils_base and utils/hub.py: the tokenizer config, the
# files its tokenizer classes name in vocab_files_names, special and added tokens, the chat templates) and vLLM's
# get_tokenizer besides (Mistral's tekken.json, tokenizer.model.v*, params.json; Kimi's tiktoken.model). Never remote
# code (tokenization_*.py): nothing here trusts it.
_TOKENIZER = [*_CONFIG, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "chat_template.jinja", "chat_template.json", "additional_chat_templates/*", "vocab.json", "merges.txt",
              "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "*.tiktoken", "tiktoken.model",
              "tekken.json", "tokenizer.model.v*", "params.json"]
_PARTS: dict[str, list[str] | None] = {"all": None, "tokenizer": _TOKENIZER, "config": _CONFIG}
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # what vLLM and transformers load a model's weights from


class ModelNotFoundError(ValueError):
    """A model reference that names no usable model directory; the message says which and what to do."""


def is_hub_id(value: str) -> bool:
    """Whether `value` is shaped like a Hugging Face model id (`org/name`); says nothing about whether it exists."""
    return (_HUB_ID.match(value) is not None and all(len(part) <= 96 for part in value.split("/"))
            and "--" not in value and ".." not in value and not value.endswith(".git"))


def model_reference(value: str | Path, base: str | Path) -> str:
    """`value`, written relative to `base`, as a reference `resolve_model` takes: an absolute path, or a Hub id.

    A value that exists under `base`, is absolute, starts with `.` or `~`, or is not shaped like `org/name` is a path
    (a local directory of the same name wins over the Hub, as in transformers); the rest are Hub ids, left as they
    are rather than joined to `base`. Nothing is read but `base`'s listing, so a config names a model that is not
    there yet (built or downloaded later) without error.
    """
    text = str(value)
    path = Path(text).expanduser()
    if path.is_absolute() or text.startswith((".", "~")) or not is_hub_id(text) or (Path(base) / path).exists():
        return os.path.normpath(Path(base) / path)
    return text


def resolve_model(reference: str | Path, what: str = "--model", looked_in: str | Path | None = None, *,
                  files: ModelFiles = "all", download: bool = True) -> Path:
    """The model directory of `reference` (as `model_reference` makes it): an absolute path, checked to be a model
    directory, or a Hub id, looked up in the cache and else downloaded.

    `what` names where it was given ("--model", "model.path") in the errors, and `looked_in` the folder
    `model_reference` found no such directory in (an id may be a mistyped path). `files` is what the caller will
    read of a Hub model: "tokenizer" or "config" fetch only those files (the directory may then hold nothing else),
    "all" a snapshot with its weights. `download` False: the cache only, as offline (a check that fetches nothing).
    Raises ModelNotFoundError, with one line that says what to do, for a path that
    is not a model directory (no config.json) and for an id that is neither cached nor downloadable.
    """
    if files not in _PARTS:
        raise ValueError(f"files {files!r} is none of {', '.join(map(repr, _PARTS))}")
    text = str(reference)
    if Path(text).is_absolute() or not is_hub_id(text):
        return _checked(Path(text).expanduser().absolute(), text, what)
    return _checked(Path(_snapshot(text, what, looked_in, files, download)), text, what)


def hub_cache() -> Path:
    """The Hugging Face hub cache as huggingface_hub computes it, from the environment as it is now."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def local_model(given: str | Path, what: str = "--model", *, files: ModelFiles = "all") -> Path:
    """The model directory a command-line value names (a path from the current directory, or a Hugging Face id);
    a ModelNotFoundError that names `what` when there is none. `files` as in `resolve_model`: a command that reads
    only a tokenizer passes "tokenizer", and a Hub model's weights are not fetched for it."""
    return resolve_model(model_reference(given, Path.cwd()), what, Path.cwd(), files=files)


def hub_id_of(model_dir: str | Path) -> str | None:
    """The Hub id of a snapshot directory in the cache (`.../models--org--name/snapshots/<commit>`), else None."""
    path = Path(model_dir)
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/")  # ids have no "--", so this inverts the folder name


def model_name(model_dir: str | Path) -> str:
    """The name an engine serves `model_dir` under: its Hub id for a snapshot in the cache (vLLM's own name for a
    model given by id), else the directory's name; never the commit hash a snapshot folder is called."""
    return hub_id_of(model_dir) or Path(model_dir).name


def _checked(path: Path, text: str, what: str) -> Path:
    path = Path(os.path.normpath(path))
    if not path.exists():
        hint = f" (looked for {str(path)!r})" if str(path) != text else ""
        raise ModelNotFoundError(f"{what} {text!r} is not a directory{hint}: give a model directory (build a tiny "
                                 "one with `harness tiny-model DIR`) or a Hugging Face id such as "
                                 "Qwen/Qwen2.5-1.5B-Instruct")
    if not (path / "config.json").is_file():
        shown = text if str(path) == text else f"{text} ({path})"
        raise ModelNotFoundError(f"{what} {shown!r} has no config.json: give a Hugging Face model directory "
                                 "(config.json, weights, tokenizer files)")
    return path


def _offline() -> bool:
    return any((os.environ.get(v) or "").upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_cli() -> str:
    """The command huggingface_hub installs: `hf` since 0.34, `huggingface-cli` before."""
    return "hf" if importlib.util.find_spec("huggingface_hub.cli.hf") else "huggingface-cli"


def _weight_files(snapshot: Path) -> list[Path]:
    return [path for pattern in _WEIGHTS for path in snapshot.glob(pattern) if path.is_file()]


def _has_weights(snapshot: Path) -> bool:
    """Whether `snapshot` holds a model's weights: a weights file, and every shard its index (*.index.json) names."""
    if not _weight_files(snapshot):
        return False
    for index in snapshot.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return False
        if not all((snapshot / shard).is_file() for shard in shards):
            return False
    return True


def _snapshot(repo_id: str, what: str, looked_in: str | Path | None, files: str, download: bool = True) -> str:
    """The cached snapshot of `repo_id` (holding `files`), downloaded first when it is not cached and the machine is
    online. A snapshot without weights is not cached for "all": a tokenizer fetched alone leaves one behind."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import (  # where every version since 0.20 exports them
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:
        raise ModelNotFoundError(f"{what} {repo_id!r} is a Hugging Face id, and huggingface_hub is not installed: "
                                 f"{install_hint('train')}, or give a model directory") from None
    cache, fetch = hub_cache(), f"`{_hub_cli()} download {repo_id}`"
    wanted = {"allow_patterns": _PARTS[files], "ignore_patterns": _IGNORED}
    partial = None
    try:  # the cache first: no network for a model already here
        found = snapshot_download(repo_id, cache_dir=cache, local_files_only=True, **wanted)
        if files != "all" or _has_weights(Path(found)):
            return found
        partial = found
    except LocalEntryNotFoundError as exc:  # huggingface_hub >= 1.x: an interrupted download is incomplete, absent
        partial = getattr(exc, "snapshot_path", None)
    folder = f"no folder in {str(looked_in)!r}" if looked_in is not None else "not a local directory"
    neither = f"is {folder}, nor in the Hugging Face cache {str(cache)!r}"
    if not download or _offline() or constants.HF_HUB_OFFLINE:
        offline = "HF_HUB_OFFLINE is set" if download else "nothing is downloaded here"
        online = "on a machine that is online (or unset HF_HUB_OFFLINE)" if download else "first"
        if partial and files == "all" and not _weight_files(Path(partial)):
            raise ModelNotFoundError(f"{what} {repo_id!r} is in the Hugging Face cache without its weights ({partial} "
                                     f"holds only some of its files, such as its tokenizer), and {offline}: fetch it "
                                     f"with {fetch} {online}")
        if partial:
            raise ModelNotFoundError(f"{what} {repo_id!r} is only partly in the Hugging Face cache ({partial}: its "
                                     f"download was interrupted), and {offline}: complete it with {fetch} "
                                     + online)
        raise ModelNotFoundError(f"{what} {repo_id!r} {neither}, and {offline}: fetch it with {fetch} "
                                 f"{online}, or give a model directory")
    part = "" if files == "all" else f"'s {files} files"
    print(f"downloading {repo_id}{part} from the Hugging Face Hub into {cache} ...", file=sys.stderr, flush=True)
    try:
        found = snapshot_download(repo_id, cache_dir=cache, **wanted)
    except GatedRepoError:
        raise ModelNotFoundError(f"{what} {repo_id!r} is gated on the Hugging Face Hub: accept its terms on its "
                                 "page, log in with `hf auth login`, then fetch it with " + fetch) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{what} {repo_id!r} {neither}, and the Hub has no such model (or it is private: "
                                 "log in with `hf auth login`): give a model directory or a Hub id") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:  # no network, the Hub down, a full disk
        why = str(exc).strip().splitlines()[0].removeprefix("Got: ")[:200] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(f"{what} {repo_id!r} {neither}, and downloading it failed ({why}): fetch it with "
                                 f"{fetch}, or give a model directory") from None
    if files == "all" and not _has_weights(Path(found)):  # huggingface_hub < 1.0 falls back to the cache unreached
        raise ModelNotFoundError(f"{what} {repo_id!r} has no weights (*.safetensors, *.bin) in {found} after its "
                                 f"download: the Hub was not reached, or the model has none; fetch it with {fetch}, or "
                                 "give a model directory")
    return found
