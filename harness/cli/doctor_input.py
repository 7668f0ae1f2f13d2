"""What `harness doctor` reads: a model directory's tokenizer and chat template, each bad input refused in one line
naming it (`check_input` before anything slow is imported, `load_tokenizer` after), and its stop tokens."""

from __future__ import annotations

import json
from pathlib import Path

from harness import install_hint
from proxy.parsing.native import check_reasoning_parser
from proxy.parsing.native import check_tool_parser as check_parser_name

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class DoctorError(ValueError):
    """Bad input: not a directory, no tokenizer, no chat template, unknown tool parser."""


def load_tokenizer(model_dir: str | Path, chat_template: str | Path | None = None):
    """The model's tokenizer (offline), with `chat_template` (a file) in place of its own when given."""
    path = Path(model_dir)
    _tokenizer_files(path)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DoctorError(f"harness doctor needs transformers ({exc}): {install_hint('train')}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DoctorError(f"no tokenizer in {str(path)!r} ({first}): the directory needs tokenizer.json or "
                          "tokenizer_config.json") from exc
    if chat_template is not None:
        tokenizer.chat_template = _template_file(chat_template).read_text(encoding="utf-8")
    if not getattr(tokenizer, "chat_template", None):
        raise _no_template(path)
    return tokenizer


def _tokenizer_files(path: Path) -> None:
    if not path.is_dir():
        raise DoctorError(f"model {str(path)!r} is not a directory: pass the model's directory (with its "
                          "tokenizer files)")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise DoctorError(f"no tokenizer in {str(path)!r}: the directory needs one of {', '.join(_TOKENIZER_FILES)}")


def _template_file(chat_template: str | Path) -> Path:
    if not Path(chat_template).is_file():
        raise DoctorError(f"chat template {str(chat_template)!r} is not a file: pass a Jinja template file")
    return Path(chat_template)


def _no_template(path: Path) -> DoctorError:
    return DoctorError(f"{str(path)!r} has no chat template (tokenizer_config.json \"chat_template\" or "
                       "chat_template.jinja): pass --chat-template FILE")


def stop_ids(tokenizer, model_dir: Path) -> dict[int, str]:
    """The model's stop tokens, each with where it was declared."""
    stops: dict[int, str] = {}
    if tokenizer.eos_token_id is not None:
        stops[tokenizer.eos_token_id] = "the tokenizer's eos"
    config = model_dir / "generation_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as exc:
            raise DoctorError(f"{str(config)!r} is not a JSON object ({exc}): fix or remove it") from exc
        for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            stops.setdefault(int(i), "generation_config.json eos_token_id")
    return stops


_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def check_input(path: Path, chat_template: str | Path | None, tool_parser: str, reasoning_parser: str | None):
    """What can be refused without loading anything, so a bad input is one line before a 20 s wait, not after.
    load_tokenizer checks the same again, and what only a loaded tokenizer can tell."""
    _tokenizer_files(path)
    if chat_template is not None:
        _template_file(chat_template)
    elif not any((path / name).exists() for name in _TEMPLATE_FILES):
        try:
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        if not (isinstance(config, dict) and config.get("chat_template")):
            raise _no_template(path)
    try:
        check_parser_name(tool_parser)
        check_reasoning_parser(reasoning_parser)
    except ValueError as exc:
        raise DoctorError(str(exc)) from exc
