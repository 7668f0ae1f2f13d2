"""Which reply parsing a proxy gets: vLLM's own parsers where vLLM is installed beside it and the model's tokenizer
is known (proxy/parsing/vllm.py), else the proxy's own (proxy/parsing/native.py)."""

from __future__ import annotations

import json
from pathlib import Path

from proxy.parsing.native import NativeParsing, ReplyParsing

__all__ = ["harmony", "reply_parsing", "vllm_available"]


def harmony(model_dir: str | None) -> bool:
    """Whether the model speaks OpenAI's harmony format (gpt-oss): vLLM's chat endpoint then renders and parses with
    openai_harmony, by token ids, where no chat template or text parser of the proxy's can follow it."""
    if model_dir is None:
        return False
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "gpt_oss"


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def reply_parsing(tool_parser: str | None, reasoning_parser: str | None = None,
                  tokenizer: str | None = None) -> ReplyParsing:
    """vLLM's own parsers when vLLM is installed here and `tokenizer` (the model's directory) is given; else the
    proxy's own, which know the Hermes format and no reasoning format (a ValueError says what to do)."""
    if tokenizer is not None and vllm_available():
        from proxy.parsing.vllm import VllmParsing

        return VllmParsing(tool_parser, reasoning_parser, tokenizer)
    return NativeParsing(tool_parser, reasoning_parser)
