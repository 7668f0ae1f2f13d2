"""The tools of a Responses request, as coding agents send them (Codex CLI), made chat tools the engine's template
and tool parser take, and the calls the model writes made the items the agent expects (proxy/wire/responses.py).

`function` tools as they are; a `namespace` tool's functions offered as `<namespace>__<name>` and answered as
`function_call` items with `name` and `namespace`; a `custom` (free-form) tool offered as a function of one string
argument, `input` (its grammar told in the description, not enforced), and answered as a `custom_tool_call`;
hosted tools (`web_search`, `file_search`, `tool_search`, ...), which the engine cannot run, left out (their types
recorded) or, with `hosted` "refuse", a 400. The chat history keeps the names and arguments the model wrote, so
the agent's history items are read back into them (`history_call`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from proxy.wire.common import bad, check, not_offered, short

__all__ = ["NAMESPACE_SEP", "Tools", "history_call", "to_chat_tools"]

NAMESPACE_SEP = "__"  # a namespace's function as the model sees it: <namespace>__<name> (any template, any parser)
_CUSTOM_INPUT = "input"  # the one argument a custom (free-form) tool is offered with


@dataclass
class Tools:
    """What the request's tools became: the chat tools, how each offered name maps back to the agent's tool, and
    the hosted tools left out."""

    chat: list[dict] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # offered name -> (namespace, name)
    custom: set[str] = field(default_factory=set)  # names of custom tools
    left_out: list[str] = field(default_factory=list)  # hosted tool types, in request order

    def as_sent(self, item: dict) -> dict:
        """An output item as the agent gets it: a call of a namespace's function under its name and namespace, a
        custom tool's call with its input (the chat history keeps the names and arguments the model wrote)."""
        name = item.get("name")
        if item["type"] != "function_call" or not name:
            return dict(item)
        if name in self.namespaced:
            namespace, fn = self.namespaced[name]
            return {**item, "name": fn, "namespace": namespace}
        if name in self.custom:
            try:
                text = json.loads(item["arguments"])[_CUSTOM_INPUT]
            except (ValueError, TypeError, KeyError):  # not (yet) the one argument: what the model wrote so far
                text = item["arguments"]
            return {"type": "custom_tool_call", "id": item["id"], "call_id": item["call_id"], "name": name,
                    "input": text if isinstance(text, str) else json.dumps(text), "status": item["status"]}
        return dict(item)


def _offered(name: str, namespace: str | None) -> str:
    """The name the model is offered (and the chat history keeps) for the agent's tool `name` in `namespace`."""
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


def _function(tool: dict, where: str, name: str | None = None) -> dict:
    fn = {"name": name or check(tool.get("name"), (str,), f"{where}.name", "a string", required=True)}
    for key, types in (("description", (str,)), ("parameters", (dict,)), ("strict", (bool,))):
        if tool.get(key) is not None:
            fn[key] = check(tool[key], types, f"{where}.{key}", types[0].__name__)
    return {"type": "function", "function": fn}


def _custom(tool: dict, where: str) -> dict:
    """A free-form tool as a function of one string: its format (a grammar, say) is told in the description, not
    enforced."""
    name = check(tool.get("name"), (str,), f"{where}.name", "a string", required=True)
    fmt = tool.get("format") if isinstance(tool.get("format"), dict) else {}
    told = f" Its input follows this {fmt.get('syntax') or fmt.get('type')}:\n{fmt['definition']}" \
        if isinstance(fmt.get("definition"), str) else ""
    description = (tool.get("description") or "") + told
    return {"type": "function", "function": {
        "name": name, "description": description.strip(),
        "parameters": {"type": "object", "properties": {_CUSTOM_INPUT: {"type": "string"}},
                       "required": [_CUSTOM_INPUT]}}}


def to_chat_tools(tools, hosted: str = "leave_out") -> Tools:
    """The request's tools as chat tools (see the module's docstring); `hosted` "refuse" makes a hosted tool a
    400 instead of leaving it out."""
    out = Tools()
    if tools is None:
        return out
    if not isinstance(tools, list):
        raise bad("tools", f"must be a list of tool objects, got {short(tools)}")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise bad(f"{where}.type", f"must be 'function', 'namespace', 'custom' or a hosted tool's, got "
                      f"{short(kind)}")
        if kind == "function":
            out.chat.append(_function(tool, where))
        elif kind == "custom":
            out.chat.append(_custom(tool, where))
            out.custom.add(out.chat[-1]["function"]["name"])
        elif kind == "namespace":
            namespace = check(tool.get("name"), (str,), f"{where}.name", "a string", required=True)
            inner = check(tool.get("tools"), (list,), f"{where}.tools", "a list", required=True)
            for j, fn in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(fn, dict) or fn.get("type", "function") != "function":
                    raise not_offered(at, "a namespace's tools must be function tools here")
                name = check(fn.get("name"), (str,), f"{at}.name", "a string", required=True)
                out.chat.append(_function(fn, at, _offered(name, namespace)))
                out.namespaced[out.chat[-1]["function"]["name"]] = (namespace, name)
        elif hosted == "refuse":
            raise not_offered(where, f"tool type '{kind}' is not offered: the engine runs no hosted tools (serve "
                              "with --hosted-tools leave_out to leave them out of the prompt instead)")
        else:  # web_search, file_search, code_interpreter, tool_search, mcp...: nothing here can run them
            out.left_out.append(kind)
    return out


def history_call(item: dict, kind: str, where: str) -> dict:
    """A function_call or custom_tool_call item as the chat tool call the model wrote: a namespace's function under
    its offered name, a custom tool's input as its one argument."""
    name = check(item.get("name"), (str,), f"{where}.name", "a string", required=True)
    if kind == "custom_tool_call":
        text = check(item.get("input"), (str,), f"{where}.input", "a string", required=True)
        arguments = json.dumps({_CUSTOM_INPUT: text}, ensure_ascii=False)
    else:
        arguments = check(item.get("arguments"), (str,), f"{where}.arguments", "a string", required=True)
        namespace = check(item.get("namespace"), (str,), f"{where}.namespace", "a string")
        name = _offered(name, namespace)
    return {"id": check(item.get("call_id"), (str,), f"{where}.call_id", "a string", required=True),
            "type": "function", "function": {"name": name, "arguments": arguments}}
