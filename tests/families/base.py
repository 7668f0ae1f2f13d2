"""A model family as the tests build it (tests/families/__init__.py says what and why)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.running.tiny_model import CHAT_TEMPLATE, build_tiny_model

__all__ = ["Family", "hermes_reply"]


@dataclass(frozen=True)
class Family:
    name: str  # the model family, e.g. "qwen3"
    tool_parser: str  # vLLM's --tool-call-parser name
    reply: Callable[[str, dict], str]  # the text one tool call is written as
    template: str = CHAT_TEMPLATE
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser name
    special_tokens: tuple[str, ...] = ()  # added as special tokens (dropped when decoding with skip_special_tokens)
    added_tokens: tuple[str, ...] = ()  # added as plain tokens (kept in decoded text)
    eos_token: str = "<|im_end|>"
    stop_tokens: tuple[str, ...] = ()  # more tokens the model stops on (generation_config.json), as the family's
    drops_reasoning: bool = False  # the template leaves earlier turns' reasoning out of the history it renders
    # token -> logit bias, over the engine tests' +100 for every marker (talk.marker_bias), where one marker must
    # outbid another that may come at the same place
    bias: dict[str, int] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def build(self, out: Path) -> Path:
        return build_tiny_model(out, seed=0, chat_template=self.template, special_tokens=self.special_tokens,
                                added_tokens=self.added_tokens, eos_token=self.eos_token,
                                stop_tokens=self.stop_tokens)

    def marker_bias(self, model: Path) -> dict[str, int]:
        """The logit bias the engine tests send for this family's model (talk.marker_bias, then `bias`)."""
        from transformers import AutoTokenizer

        from tests.families.talk import marker_bias

        out = marker_bias(model)
        if self.bias:
            tokenizer = AutoTokenizer.from_pretrained(model)
            added = tokenizer.get_added_vocab()
            out.update({str(added[token]): b for token, b in self.bias.items()})  # KeyError: not one of its markers
        return out


def hermes_reply(name: str, arguments: dict) -> str:
    """Hermes-style: `<tool_call>` + compact JSON of name and arguments + `</tool_call>`."""
    call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>\n{call}\n</tool_call>"
