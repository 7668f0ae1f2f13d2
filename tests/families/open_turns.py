"""A family whose template closes no turn (as GLM-4's): each message is its role token and its text, and the model
stops on the role token of the message that follows (`<|observation|>` after a tool call, `<|user|>` after an
answer), so the token that ends a reply is the first token of the next message's render.

Written for the tests in the GLM-4 layout (`<|system|>`, `<|user|>`, `<|assistant|>`, `<|observation|>`, stop on
`<|user|>` and `<|observation|>`) with Hermes tool calls, so vLLM's hermes parser reads it: what this family tests
is the turn layout, which GLM-4.5 shares (its own glm45 tool format is in tests/families/tagged.py). The role
tokens are plain added tokens here, so a reply forced by a regex can end on its stop token.
"""

from __future__ import annotations

import json

from tests.families.base import Family

ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

TEMPLATE = r"""{%- if tools or messages[0].role == 'system' %}
    {{- '<|system|>\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- endif %}
    {%- if tools %}
        {{- '\n# Tools\nCall a function by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n' }}
        {%- for tool in tools %}
            {{- tool | tojson }}
            {{- '\n' }}
        {%- endfor %}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|user|>\n' + message.content }}
    {%- elif message.role == 'assistant' %}
        {{- '<|assistant|>\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + arguments + '}\n</tool_call>' }}
        {%- endfor %}
    {%- elif message.role == 'tool' %}
        {{- '<|observation|>\n' + message.content }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
{%- endif %}"""


def _reply(name: str, arguments: dict) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>\n{call}\n</tool_call><|observation|>"  # the model stops on the next message's role


OPEN_TURNS = Family("open-turns", "hermes", _reply, template=TEMPLATE, added_tokens=ROLES,
                    eos_token="<|user|>", stop_tokens=("<|observation|>",))

FAMILIES = (OPEN_TURNS,)
