"""The proxy's HTTP surface as an OpenAPI 3.0 description, served at `GET /openapi.json`.

What clients may send and what they get back, route by route (docs/proxy.md says what each route does). Request
bodies are described as loosely as the proxy takes them: the fields it reads, with their types, and any others
passed on; every error is the OpenAI error object (Anthropic's on /v1/messages). tests/proxy/test_openapi.py checks that
the description lists exactly the routes the proxy serves, and runs schemathesis against a live proxy with it.
"""

from __future__ import annotations

from harness import __version__

EPISODE_ID = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"
LLM_ROUTES = ("chat/completions", "completions", "responses", "messages")  # recorded, plain and per episode

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True}, "code": {"nullable": True}},
    }},
}
_ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"type": "string", "enum": ["error"]},
                   "error": {"type": "object", "required": ["type", "message"],
                             "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "array", "items": {}}]},
                   "name": {"type": "string"}, "tool_call_id": {"type": "string"},
                   "tool_calls": {"type": "array", "items": {"type": "object"}}},
}
_SAMPLING = {
    "model": {"type": "string"}, "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number", "minimum": 0,
                                                                            "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
}
_REQUESTS = {
    "chat/completions": {
        "type": "object", "required": ["messages"],
        "properties": {**_SAMPLING, "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": _MESSAGE},
                       "n": {"type": "integer", "minimum": 1, "maximum": 4},
                       "tools": {"type": "array", "items": {"type": "object"}},
                       "stream_options": {"type": "object"}},
    },
    "completions": {
        "type": "object", "required": ["prompt"],
        "properties": {**_SAMPLING, "n": {"type": "integer", "minimum": 1, "maximum": 4},
                       "prompt": {"oneOf": [{"type": "string"},
                                            {"type": "array", "minItems": 1, "maxItems": 64,
                                             "items": {"type": "integer", "minimum": 0, "maximum": 999}}]}},
    },
    "responses": {
        "type": "object", "required": ["input"],
        "properties": {**{k: v for k, v in _SAMPLING.items() if k != "max_tokens"},
                       "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
                       "instructions": {"type": "string"},
                       "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}},
    },
    "messages": {
        "type": "object", "required": ["messages", "max_tokens"],
        "properties": {**_SAMPLING, "system": {"type": "string"},
                       "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                           "type": "object", "required": ["role", "content"],
                           "properties": {"role": {"type": "string", "enum": ["user", "assistant"]},
                                          "content": {"oneOf": [{"type": "string"},
                                                                {"type": "array", "items": {"type": "object"}}]}}}}},
    },
}
_ANSWERS = {  # the 200 bodies (a stream is text/event-stream)
    "chat/completions": {"type": "object", "required": ["id", "object", "choices"],
                         "properties": {"object": {"type": "string", "enum": ["chat.completion"]},
                                        "choices": {"type": "array", "items": {"type": "object"}}}},
    "completions": {"type": "object", "required": ["id", "object", "choices"],
                    "properties": {"object": {"type": "string", "enum": ["text_completion"]},
                                   "choices": {"type": "array", "items": {"type": "object"}}}},
    "responses": {"type": "object", "required": ["id", "object", "output"],
                  "properties": {"object": {"type": "string", "enum": ["response"]},
                                 "output": {"type": "array", "items": {"type": "object"}}}},
    "messages": {"type": "object", "required": ["id", "type", "content"],
                 "properties": {"type": {"type": "string", "enum": ["message"]},
                                "content": {"type": "array", "items": {"type": "object"}}}},
}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(error: dict, *statuses: str) -> dict:
    """The error responses of an operation: 4XX always; the 5XX the proxy passes on when the engine fails."""
    return {s: _json(error, "an error, in the API's own shape") for s in ("4XX", *statuses)}


def _llm(route: str) -> dict:
    error = _ANTHROPIC_ERROR if route == "messages" else _ERROR
    ok = {"description": "the answer; with stream: true, server-sent events",
          "content": {"application/json": {"schema": _ANSWERS[route]}, "text/event-stream": {"schema": {}}}}
    return {"post": {
        "summary": f"/v1/{route}, recorded",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _REQUESTS[route]}}},
        "responses": {"200": ok, **_errors(error, "502", "503", "504")},
    }}


def _admin(method: str, summary: str, body: dict | None, answer: dict) -> dict:
    op = {"summary": summary, "security": [{"admin": []}],
          "responses": {"200": _json(answer, "done"), **_errors(_ERROR)}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return {method: op}


def openapi() -> dict:
    """The OpenAPI description of the proxy's routes."""
    episode = {"name": "episode", "in": "path", "required": True,
               "schema": {"type": "string", "pattern": EPISODE_ID}}
    paths: dict[str, dict] = {}
    for route in LLM_ROUTES:
        paths[f"/v1/{route}"] = _llm(route)
        per_episode = _llm(route)
        per_episode["post"]["parameters"] = [episode]
        per_episode["post"]["summary"] += " into episode {episode}"
        paths[f"/e/{{episode}}/v1/{route}"] = per_episode
    deployment = {"name": "deployment", "in": "path", "required": True, "schema": {"type": "string"}}
    for route in ("chat/completions", "completions"):  # Azure OpenAI's deployment URLs
        for prefix, parameters in (("", [deployment]), ("/e/{episode}", [episode, deployment])):
            azure = _llm(route)
            azure["post"]["parameters"] = parameters
            azure["post"]["summary"] += " (Azure OpenAI's URL; the deployment names the model when the body does not)"
            paths[f"{prefix}/openai/deployments/{{deployment}}/{route}"] = azure
    models = {"get": {"summary": "the engine's models, passed through",
                      "responses": {"200": _json({"type": "object"}, "the model list"),
                                    **_errors(_ERROR, "502", "503", "504")}}}
    paths["/v1/models"] = models
    paths["/e/{episode}/v1/models"] = {"get": {**models["get"], "parameters": [episode]}}
    paths["/v1/embeddings"] = {"post": {
        "summary": "an example of a /v1 route the proxy does not serve itself: passed to the engine unrecorded "
                   "(any GET or POST /v1/...); a 501 when the engine does not offer it",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
        "responses": {"200": _json({"type": "object"}, "the engine's answer"),
                      **_errors(_ERROR, "501", "502", "503", "504")},
    }}
    paths["/health"] = {"get": {"summary": "liveness, no auth", "responses": {"200": _json(
        {"type": "object", "required": ["status", "run_id"], "properties": {"status": {"type": "string"}}},
        "alive")}}}
    paths["/openapi.json"] = {"get": {"summary": "this description, no auth",
                                      "responses": {"200": _json({"type": "object"}, "OpenAPI 3.0")}}}
    paths["/harness/sql"] = _admin("post", "read-only SQL over the live database", {
        "type": "object", "required": ["sql"],
        "properties": {"sql": {"type": "string"}, "params": {"type": "array"},
                       "max_rows": {"type": "integer", "minimum": 0, "maximum": 10**9}},
    }, {"type": "object", "required": ["columns", "types", "rows", "truncated"]})
    paths["/harness/episodes"] = _admin("post", "open an episode; its api key", {
        "type": "object", "properties": {"episode_id": {"type": "string", "pattern": EPISODE_ID},
                                         "meta": {"type": "object"}},
    }, {"type": "object", "required": ["episode_id", "api_key", "base_path"]})
    paths["/harness/weights"] = _admin("post", "the policy weight version stamped on calls from now on; with "
                                       "model, the engine's name for the default policy's (or with policy, that "
                                       "policy's) calls", {
        "type": "object", "required": ["version"],
        "properties": {"version": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                       "model": {"type": "string", "minLength": 1, "maxLength": 256},
                       "policy": {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,256}$"}},
    }, {"type": "object", "required": ["weight_version", "served_model", "policy_models"],
        "properties": {"policy_models": {"type": "object", "additionalProperties": {"type": "string",
                                                                                     "nullable": True}}}})
    per_status = {"type": "object", "additionalProperties": {"type": "integer"}}  # "503" -> count
    paths["/harness/status"] = _admin(
        "get", "run id, weight version, recorder and episode counters, calls only forwarded (by route and status)",
        None, {"type": "object", "required": ["run_id", "weight_version"],
               "properties": {"forwarded": {"type": "object", "additionalProperties": per_status}}})
    return {
        "openapi": "3.0.3",
        "info": {"title": "harness recording proxy", "version": __version__,
                 "description": "An OpenAI-compatible proxy that records every call (docs/proxy.md)."},
        "paths": paths,
        "components": {"securitySchemes": {
            "admin": {"type": "http", "scheme": "bearer", "description": "the admin token from <db>.proxy.json"},
        }},
    }
