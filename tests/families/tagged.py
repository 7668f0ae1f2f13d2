"""Families whose tool calls are framed by their own tags or tokens: Qwen3-Coder (XML), Kimi K2
(`<|tool_call_begin|>` sections), DeepSeek-V3 (`<｜tool▁call▁begin｜>` with fenced JSON), and GLM-4.5 (`<arg_key>` and
`<arg_value>` pairs, `<think>` reasoning).

Each template is written here from the family's published format; what each renders:
- the tools (as the family lays them out), the system message, user messages;
- an assistant turn with content, reasoning (the reasoning families), and tool calls whose arguments may come as a
  JSON string (OpenAI wire format, as transformers passes them) or an object (as vLLM passes them). The XML formats
  write one tag per argument, which needs an object: a string there is written as one raw block;
- tool results, and the generation prompt.
"""

from __future__ import annotations

import json

from tests.families.base import Family

# Macros the templates below share: `text(content)`, a message's content as text (a string, or the text parts of a
# list); `tool_list(tools)`, the tools as JSON lines in `<tools></tools>` under a `# Tools` heading and the hermes-like
# preamble GLM-4.5 and DeepSeek-V3 both write, ending in a blank line (each template follows with how to call).
SHARED_MACROS = r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part is string -%}
                {{- part -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_list(tools) -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\n' -}}
{%- endmacro -%}
"""

# ---------------------------------------------------------------------------------------------------------------
# Qwen3-Coder: ChatML, tools listed as <function> XML in the system message, calls as
#   <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>
# Its markers are Qwen3's: <tool_call> and </tool_call> are plain added tokens; <function=...> and <parameter=...>
# are ordinary text.

QWEN3_CODER_TEMPLATE = r"""{%- macro scalar(value) -%}
    {%- if value is mapping or (value is iterable and value is not string) -%}
        {{- value | tojson -}}
    {%- else -%}
        {{- value | string -}}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system = messages[0].content -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set system = none -%}
    {%- set rest = messages -%}
{%- endif -%}
{%- if system is not none or tools -%}
    {{- '<|im_start|>system\n' + (system if system is not none else 'You are a helpful coding assistant.') -}}
    {%- if tools -%}
        {{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
        {%- for tool in tools -%}
            {%- set fn = tool.function if tool.function is defined else tool -%}
            {{- '\n<function>\n<name>' + fn.name + '</name>' -}}
            {%- if fn.description is defined and fn.description -%}
                {{- '\n<description>' + fn.description | trim + '</description>' -}}
            {%- endif -%}
            {{- '\n<parameters>' -}}
            {%- if fn.parameters is defined and fn.parameters.properties is defined -%}
                {%- for pname, pspec in fn.parameters.properties | items -%}
                    {{- '\n<parameter>\n<name>' + pname + '</name>' -}}
                    {%- if pspec.type is defined -%}
                        {{- '\n<type>' + scalar(pspec.type) + '</type>' -}}
                    {%- endif -%}
                    {%- if pspec.description is defined -%}
                        {{- '\n<description>' + pspec.description | trim + '</description>' -}}
                    {%- endif -%}
                    {{- '\n</parameter>' -}}
                {%- endfor -%}
            {%- endif -%}
            {%- if fn.parameters is defined and fn.parameters.required is defined -%}
                {{- '\n<required>' + fn.parameters.required | tojson + '</required>' -}}
            {%- endif -%}
            {{- '\n</parameters>\n</function>' -}}
        {%- endfor -%}
        {{- '\n</tools>\n\nTo call a function, reply in this format and nothing after it:\n\n' -}}
        {{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter>\nvalue\n' -}}
        {{- '</parameter>\n</function>\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in rest -%}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant' -}}
        {%- if message.content is string and message.content | trim -%}
            {{- '\n' + message.content | trim + '\n' -}}
        {%- endif -%}
        {%- for call in message.tool_calls -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\n<tool_call>\n<function=' + fn.name + '>\n' -}}
            {%- if fn.arguments is mapping -%}
                {%- for key, value in fn.arguments | items -%}
                    {{- '<parameter=' + key + '>\n' + scalar(value) + '\n</parameter>\n' -}}
                {%- endfor -%}
            {%- elif fn.arguments is string -%}
                {{- fn.arguments + '\n' -}}
            {%- endif -%}
            {{- '</function>\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user\n' -}}
        {%- endif -%}
        {{- '<tool_response>\n' + (message.content or '') + '\n</tool_response>\n' -}}
        {%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def qwen3_coder_reply(name: str, arguments: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


QWEN3_CODER = Family("qwen3_coder", "qwen3_xml", qwen3_coder_reply, template=QWEN3_CODER_TEMPLATE)

# ---------------------------------------------------------------------------------------------------------------
# GLM-4.5: `[gMASK]<sop>`, then role tokens and no end-of-turn token: a turn ends where the next role token
# begins, and the model stops on `<|user|>` or `<|observation|>` (its generation config's eos ids). Calls as
#   <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>
# Reasoning `<think>...</think>` right after `<|assistant|>`; turns before the last user message keep only an empty
# `<think></think>`. All of GLM's added tokens are special (vLLM's glm45 parser asks for them undecoded).

GLM45_TEMPLATE = SHARED_MACROS + r"""{{- '[gMASK]<sop>' -}}
{%- if tools -%}
    {{- '<|system|>\n' + tool_list(tools) -}}
    {{- 'For each function call, output the function name and arguments in this XML format:\n' -}}
    {{- '<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n' -}}
    {{- '...\n</tool_call>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {{- '<|system|>\n' + text(message.content) -}}
    {%- elif message.role == 'user' -%}
        {{- '<|user|>\n' + text(message.content) -}}
        {%- if enable_thinking is defined and not enable_thinking -%}
            {{- '/nothink' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning_content or message.reasoning or '' -%}
        {{- '<|assistant|>' -}}
        {%- if loop.index0 > ns.last_user and reasoning -%}
            {{- '\n<think>' + reasoning | trim + '</think>' -}}
        {%- else -%}
            {{- '\n<think></think>' -}}
        {%- endif -%}
        {%- set content = text(message.content) -%}
        {%- if content | trim -%}
            {{- '\n' + content | trim -}}
        {%- endif -%}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\n<tool_call>' + fn.name + '\n' -}}
            {%- if fn.arguments is mapping -%}
                {%- for key, value in fn.arguments | items -%}
                    {{- '<arg_key>' + key + '</arg_key>\n<arg_value>' -}}
                    {{- value if value is string else value | tojson -}}
                    {{- '</arg_value>\n' -}}
                {%- endfor -%}
            {%- elif fn.arguments is string -%}
                {{- fn.arguments + '\n' -}}
            {%- endif -%}
            {{- '</tool_call>' -}}
        {%- endfor -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|observation|>' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '\n<think></think>' -}}
    {%- endif -%}
{%- endif -%}
"""


def glm45_reply(name: str, arguments: dict) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in arguments.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


GLM45 = Family(
    "glm4.5", "glm45", glm45_reply, template=GLM45_TEMPLATE, reasoning_parser="glm45",
    special_tokens=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                    "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                    "</arg_key>", "<arg_value>", "</arg_value>"),
    eos_token="<|user|>", stop_tokens=("<|observation|>",), drops_reasoning=True,
    # vLLM's glm45 tool parser sets tool strict level FUNCTION as its default (--tool-strict-level auto cannot go
    # below it), so with tools a request's regex is OR-ed with its tool-call tag (GLM-4.7's layout, no text before
    # the call, values free), on the engine's chat endpoint and in the proxy alike. The tag opens on `<tool_call>`
    # and the reply on `<think>`: `<think>` outbids `<tool_call>` at the first token, which rules the tag out and
    # leaves the regex. A call's reply then stops on `<|observation|>`, where the tool results' render begins.
    bias={"<tool_call>": 50, "<|user|>": 50},
    notes={"stops": "no end-of-turn token: a reply ends on the stop token that opens the next message, which the "
                    "proxy continues from (proxy/splice.py: the template closes no turn)"})

# ---------------------------------------------------------------------------------------------------------------
# Kimi K2 (Instruct): `<|im_system|>`/`<|im_user|>`/`<|im_assistant|>` + role name + `<|im_middle|>` ... `<|im_end|>`;
# tools declared as JSON in a `tool_declare` system turn; calls as
#   <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}
#   <|tool_call_end|><|tool_calls_section_end|>
# whose header is the call's id; results as `## Return of ID`. Its `<|...|>` tokens are special; the kimi_k2 tool
# parser asks for them undecoded.
# Not Kimi K2 Thinking (`--reasoning-parser kimi_k2`, `<think>...</think>` opening each assistant turn): vLLM 0.32's
# kimi_k2 parser names no turn-boundary tokens, so when streaming it finds the `</think>` of an earlier turn in the
# prompt, takes reasoning as already ended, and streams the new turn's reasoning as content (`<think>` included,
# `</think>` dropped); its whole-reply parse is right. The engine's chat endpoint does exactly the same (notes).

KIMI_K2_TEMPLATE = SHARED_MACROS + r"""{%- if tools -%}
    {{- '<|im_system|>tool_declare<|im_middle|>' + tools | tojson + '<|im_end|>' -}}
{%- endif -%}
{%- if not messages or messages[0].role != 'system' -%}
    {{- '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {{- '<|im_user|>user<|im_middle|>' + text(message.content) -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_assistant|>assistant<|im_middle|>' + text(message.content) -}}
        {%- if message.tool_calls -%}
            {{- '<|tool_calls_section_begin|>' -}}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' -}}
                {{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}
                {{- '<|tool_call_end|>' -}}
            {%- endfor -%}
            {{- '<|tool_calls_section_end|>' -}}
        {%- endif -%}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_system|>tool<|im_middle|>## Return of ' + message.tool_call_id + '\n' + text(message.content) -}}
    {%- else -%}
        {{- '<|im_system|>' + message.role + '<|im_middle|>' + text(message.content) -}}
    {%- endif -%}
    {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- endif -%}
"""


def kimi_k2_reply(name: str, arguments: dict) -> str:
    args = json.dumps(arguments, separators=(",", ":"))
    return (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{args}"
            "<|tool_call_end|><|tool_calls_section_end|>")


KIMI_K2 = Family(
    "kimi_k2", "kimi_k2", kimi_k2_reply, template=KIMI_K2_TEMPLATE,
    special_tokens=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    notes={"no_reasoning_parser": "vLLM 0.32's kimi_k2 reasoning parser has no turn boundaries: streamed, every "
                                  "turn after the first comes out as content (engine and proxy alike)"})

# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3: `<｜begin▁of▁sentence｜>` + system text (+ tools), then `<｜User｜>...<｜Assistant｜>`; an assistant
# turn ends with `<｜end▁of▁sentence｜>`. Calls as
#   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{JSON}\n```<｜tool▁call▁end｜>
#   <｜tool▁calls▁end｜>
# results as `<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>...<｜tool▁output▁end｜><｜tool▁outputs▁end｜>`, after
# which the assistant goes on without a new `<｜Assistant｜>`. Only the sentence tokens are special: the role and
# tool tokens are plain added tokens (the deepseek_v3 parser reads them from the decoded text).

DEEPSEEK_V3_TEMPLATE = SHARED_MACROS + r"""
{%- set ns = namespace(system='', in_tools=false, first_output=true, last_user=false) -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- set ns.system = ns.system + ('\n\n' if ns.system else '') + message.content -%}
    {%- endif -%}
{%- endfor -%}
{{- '<｜begin▁of▁sentence｜>' + ns.system -}}
{%- if tools -%}
    {{- '\n\n' + tool_list(tools) -}}
    {{- 'To call functions, write <｜tool▁calls▁begin｜>, then each call as\n' -}}
    {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜><function_name>\n```json\n<arguments as JSON>\n```' -}}
    {{- '<｜tool▁call▁end｜>\nand after the last one <｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.in_tools = false -%}
        {%- set ns.last_user = true -%}
        {{- '<｜User｜>' + message.content + '<｜Assistant｜>' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set ns.last_user = false -%}
        {%- if ns.in_tools -%}
            {{- '<｜tool▁outputs▁end｜>' -}}
            {%- set ns.in_tools = false -%}
        {%- endif -%}
        {{- message.content or '' -}}
        {%- if message.tool_calls -%}
            {%- set ns.first_output = true -%}
            {{- '<｜tool▁calls▁begin｜>' -}}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {{- ('\n' if not loop.first else '') + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + fn.name -}}
                {{- '\n```json\n' + (fn.arguments if fn.arguments is string else fn.arguments | tojson) -}}
                {{- '\n```<｜tool▁call▁end｜>' -}}
            {%- endfor -%}
            {{- '<｜tool▁calls▁end｜>' -}}
        {%- endif -%}
        {{- '<｜end▁of▁sentence｜>' -}}
    {%- elif message.role == 'tool' -%}
        {%- set ns.last_user = false -%}
        {%- set ns.in_tools = true -%}
        {{- ('<｜tool▁outputs▁begin｜>' if ns.first_output else '\n') -}}
        {{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' -}}
        {%- set ns.first_output = false -%}
    {%- endif -%}
{%- endfor -%}
{%- if ns.in_tools -%}
    {{- '<｜tool▁outputs▁end｜>' -}}
{%- endif -%}
{%- if add_generation_prompt and not ns.last_user and not ns.in_tools -%}
    {{- '<｜Assistant｜>' -}}
{%- endif -%}
"""


def deepseek_v3_reply(name: str, arguments: dict) -> str:
    args = json.dumps(arguments, separators=(",", ":"))
    return (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


DEEPSEEK_V3 = Family(
    "deepseek_v3", "deepseek_v3", deepseek_v3_reply, template=DEEPSEEK_V3_TEMPLATE,
    special_tokens=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    added_tokens=("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                  "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
    eos_token="<｜end▁of▁sentence｜>")

FAMILIES = (QWEN3_CODER, GLM45, KIMI_K2, DEEPSEEK_V3)
