"""Families whose tool calls are JSON or Python-like text: Llama 3.1 (JSON), Llama 3.2 (pythonic) and Mistral.

Llama 3.1 (`llama3_json`): `<|start_header_id|>role<|end_header_id|>\\n\\n` + text + `<|eot_id|>` per turn, tools in
the first user message, a call is the bare JSON `{"name": ..., "parameters": {...}}`, tool results come back in the
`ipython` role. Llama 3.2 (`pythonic`): the same layout, tools in the system message, a call is a Python list of
calls `[add(a=1)]`. Every Llama marker is a special token, as Llama ships them; neither reply needs one.

Mistral (`mistral`): vLLM's parser picks the format from the vocabulary (a Hugging Face tokenizer has no version):
without `[ARGS]` it reads the v3 format (Mistral 7B Instruct v0.3) `[TOOL_CALLS][{"name": ..., "arguments": ...}]`;
with `[ARGS]` the v11+ format `[TOOL_CALLS]add[ARGS]{...}` (Mistral Small 3.x, Devstral, Magistral). Both are here:
`mistral` (v3) and `mistral-v13`. Mistral's control tokens are special, as it ships them: vLLM's parser turns
`skip_special_tokens` off for requests with tools, so `[TOOL_CALLS]` stays in the text it parses.
"""

from __future__ import annotations

import json

from tests.families.base import Family

# --- Llama 3.1 / 3.2 -----------------------------------------------------------------------------------------------

LLAMA_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>")

# Shared by both Llama templates: the system header (a fixed date unless the caller passes `date_string`, so two
# renders of one conversation agree), the turns, and tool results in the ipython role. `CALL` renders one call,
# `TOOLS_IN_SYSTEM` / `TOOLS_IN_USER` present the tools.
_LLAMA = r"""{{- '<|begin_of_text|>' }}
{%- set date = date_string if date_string is defined else '26 Jul 2024' %}
{%- set system = '' %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}
    {{- 'Environment: ipython\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date + '\n\n' }}
TOOLS_IN_SYSTEM
{{- system + '<|eot_id|>' }}
TOOLS_IN_USER
{%- for message in messages %}
    {%- if message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {{- message.content | tojson }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- if message.content %}
            {{- message.content | trim }}
        {%- endif %}
CALL
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content or '') | trim }}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Llama 3.1: the tools go in the first user message, with the JSON call format spelled out; a call is
# {"name": ..., "parameters": ...} (several are joined by "; ", which vLLM's parser splits on).
LLAMA31_TEMPLATE = _LLAMA.replace("TOOLS_IN_SYSTEM\n", "").replace("TOOLS_IN_USER", r"""{%- if tools and messages %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '
        'that best answers the given prompt.\n\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
        'Do not use variables.\n\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\n\n' }}
    {%- endfor %}
    {{- (messages[0].content or '') | trim + '<|eot_id|>' }}
    {%- set messages = messages[1:] %}
{%- endif %}""").replace("CALL", r"""        {%- for call in message.tool_calls %}
            {%- set call = call.function if call.function is defined else call %}
            {%- if not loop.first %}
                {{- '; ' }}
            {%- endif %}
            {{- '{"name": "' + call.name + '", "parameters": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}' }}
        {%- endfor %}""")


def llama_json_reply(name: str, arguments: dict) -> str:
    """Llama 3.1 with custom tools: the bare JSON object, `parameters` for the arguments."""
    return json.dumps({"name": name, "parameters": arguments})


# Llama 3.2: the tools go in the system message, a call is a Python list of calls. Argument values are written as
# Python literals (strings double-quoted, True/False/None); arguments that arrive as a JSON string cannot be taken
# apart in Jinja and are passed whole as `name(**{...})`.
LLAMA32_PYTHONIC_TEMPLATE = (r"""{%- macro py(v) %}
    {%- if v is boolean %}
        {{- 'True' if v else 'False' }}
    {%- elif v is none %}
        {{- 'None' }}
    {%- elif v is string %}
        {{- v | tojson }}
    {%- elif v is mapping %}
        {{- '{' }}
        {%- for k in v %}
            {{- (k | tojson) + ': ' + py(v[k]) + (', ' if not loop.last else '') }}
        {%- endfor %}
        {{- '}' }}
    {%- elif v is iterable %}
        {{- '[' }}
        {%- for item in v %}
            {{- py(item) + (', ' if not loop.last else '') }}
        {%- endfor %}
        {{- ']' }}
    {%- else %}
        {{- v | string }}
    {%- endif %}
{%- endmacro %}
""" + _LLAMA).replace("TOOLS_IN_USER\n", "").replace("TOOLS_IN_SYSTEM", r"""{%- if tools %}
    {{- 'You can call functions. To call them, answer with nothing but a Python list of calls, in the format '
        '[func_name1(param_name1=value1, param_name2=value2), func_name2(params)]. Do not use variables.\n\n'
        'The functions, in JSON format:\n\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\n\n' }}
    {%- endfor %}
{%- endif %}""").replace("CALL", r"""        {{- '[' }}
        {%- for call in message.tool_calls %}
            {%- set call = call.function if call.function is defined else call %}
            {{- call.name + '(' }}
            {%- if call.arguments is string %}
                {{- '**' + call.arguments }}
            {%- else %}
                {%- for key in call.arguments %}
                    {{- key + '=' + py(call.arguments[key]) + (', ' if not loop.last else '') }}
                {%- endfor %}
            {%- endif %}
            {{- ')' + (', ' if not loop.last else '') }}
        {%- endfor %}
        {{- ']' }}""")


def _py(value) -> str:
    """A JSON value as a Python literal, the way the template writes it."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    return repr(value)


def pythonic_reply(name: str, arguments: dict) -> str:
    """Llama 3.2: a Python list with one call, keyword arguments."""
    return f"[{name}(" + ", ".join(f"{k}={_py(v)}" for k, v in arguments.items()) + ")]"


LLAMA31 = Family("llama3.1", "llama3_json", llama_json_reply, template=LLAMA31_TEMPLATE, special_tokens=LLAMA_TOKENS,
                 eos_token="<|eot_id|>")
LLAMA32_PYTHONIC = Family("llama3.2-pythonic", "pythonic", pythonic_reply, template=LLAMA32_PYTHONIC_TEMPLATE,
                          special_tokens=LLAMA_TOKENS, eos_token="<|eot_id|>")

# --- Mistral ---------------------------------------------------------------------------------------------------------

MISTRAL_TOKENS = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]")

# Mistral 7B Instruct v0.3 (tokenizer v3): the tools and the system prompt go with the last user message, a call
# turn is `[TOOL_CALLS]` + a JSON list of {"name", "arguments", "id"} + `</s>`, a result is `[TOOL_RESULTS]` +
# {"content", "call_id"} + `[/TOOL_RESULTS]`. No generation prompt: the model answers right after `[/INST]` or
# `[/TOOL_RESULTS]`. Call ids are Mistral's 9 alphanumeric characters; a longer id is cut to its last 9.
MISTRAL_TEMPLATE = r"""{{- '<s>' }}
{%- set system = '' %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if loop.index0 == ns.last_user and tools %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' }}
        {%- if loop.index0 == ns.last_user and system %}
            {{- system + '\n\n' }}
        {%- endif %}
        {{- message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS][' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "arguments": ' }}
            {%- if call.function.arguments is string %}
                {{- call.function.arguments }}
            {%- else %}
                {{- call.function.arguments | tojson }}
            {%- endif %}
            {%- if call.id %}
                {{- ', "id": "' + call.id[-9:] + '"' }}
            {%- endif %}
            {{- '}' + (', ' if not loop.last else '') }}
        {%- endfor %}
        {{- ']</s>' }}
    {%- elif message.role == 'assistant' %}
        {{- (message.content or '') + '</s>' }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]{"content": ' + message.content | tojson }}
        {%- if message.tool_call_id %}
            {{- ', "call_id": "' + message.tool_call_id[-9:] + '"' }}
        {%- endif %}
        {{- '}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""


def mistral_reply(name: str, arguments: dict) -> str:
    """Mistral v3: `[TOOL_CALLS]` + a JSON list of calls (the model writes no id)."""
    return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": arguments}])


MISTRAL = Family("mistral", "mistral", mistral_reply, template=MISTRAL_TEMPLATE, special_tokens=MISTRAL_TOKENS,
                 eos_token="</s>")

# Mistral's tokenizer v11 and later (Mistral Small 3.x, Devstral): `[ARGS]` in the vocabulary switches vLLM's parser
# to this format. The v13 layout: `[SYSTEM_PROMPT]` first, the tools before the first user message, each call
# `[TOOL_CALLS]` + name + `[ARGS]` + its JSON arguments (no call ids), a result `[TOOL_RESULTS]` + its content +
# `[/TOOL_RESULTS]`. No `[THINK]` token: with it, vLLM's parser would also read `[THINK]...[/THINK]` as reasoning.
MISTRAL_V13_TEMPLATE = r"""{{- '<s>' }}
{%- if messages and messages[0].role == 'system' %}
    {{- '[SYSTEM_PROMPT]' + messages[0].content + '[/SYSTEM_PROMPT]' }}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- set ns = namespace(tools_done=false) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and not ns.tools_done %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {%- set ns.tools_done = true %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' }}
            {%- if call.function.arguments is string %}
                {{- call.function.arguments }}
            {%- else %}
                {{- call.function.arguments | tojson }}
            {%- endif %}
        {%- endfor %}
        {{- '</s>' }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""


def mistral_v13_reply(name: str, arguments: dict) -> str:
    """Mistral v11+: `[TOOL_CALLS]` + the name + `[ARGS]` + the JSON arguments."""
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"


MISTRAL_V13 = Family("mistral-v13", "mistral", mistral_v13_reply, template=MISTRAL_V13_TEMPLATE,
                     special_tokens=(*MISTRAL_TOKENS, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]"),
                     eos_token="</s>")

FAMILIES = (LLAMA31, LLAMA32_PYTHONIC, MISTRAL, MISTRAL_V13)
