"""The proxy as an aiohttp application: the OpenAI surface and the path of one call (the admin surface is
proxy/admin.py, the routes only forwarded proxy/passthrough.py, the shared state proxy/state.py).

    agent -> /v1/chat/completions -> request.prepare -> forward.forward -> engine
                                                      \\-> Recorder -> DuckDB

Each request body is parsed once (`_prepare`: a wire format's translation hands on a dict), serialised once per
upstream attempt (`_plan_call`), and every `Call` record is built by proxy/forward.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import uuid
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from harness import __version__
from harness.core.flags import max_tokens_of
from harness.core.records import CANCELLED, ERROR, NONE, OK
from harness.store.database import Store
from harness.store.recorder import Recorder
from proxy.admin import add_admin_routes
from proxy.chat_answer import ChatAnswer
from proxy.config import ProxyConfig
from proxy.continuity import Timelines, completions_body, plan, prefix_hashes
from proxy.engine_client import EngineClient
from proxy.episodes import Episodes
from proxy.forward import Capture, forward, refused_call
from proxy.guard import GuardConfig, degenerate, ended_flag, ended_why, flags_of
from proxy.http_json import ApiError, error_middleware, json_response, parse_json_object, read_body
from proxy.openapi import openapi
from proxy.parsing import harmony, reply_parsing
from proxy.passthrough import models, passthrough
from proxy.record_only import Forwarded, forwarded
from proxy.request import CHAT, COMPLETIONS, Prepared, as_sent, for_engine, read_request
from proxy.roles import DEFAULT_POLICY, RoleRule, find_role, policy_of
from proxy.state import (
    CONFIG,
    ENGINE_CLIENT,
    ENGINES,
    EPISODES,
    RECORDER,
    RESPONSES,
    SESSION,
    STATE,
    STORE,
    RunState,
    check_agent_auth,
    request_key,
)
from proxy.upstreams import EPISODE_HEADER, Engines, healthy
from proxy.wire.common import ConversationStore, Wire
from proxy.wire.messages import MessagesWire
from proxy.wire.responses import ResponsesWire

log = logging.getLogger("harness.proxy")


def create_app(config: ProxyConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[error_middleware])
    app[CONFIG] = config
    state = app[STATE] = RunState(
        run_id=uuid.uuid4().hex[:16], served_model=config.default_model, sampling=config.sampling,
        policy_models={p: m for p, m in config.policy_models.items() if p != DEFAULT_POLICY})
    if config.token_exact and harmony(config.tokenizer):
        log.warning("token-exact continuity is off for %s: gpt-oss renders and parses the harmony format with "
                    "openai_harmony, not the chat template that /tokenize renders; every call is served by the "
                    "engine's chat endpoint (docs/proxy.md)", config.tokenizer)
    elif config.token_exact and config.returns_token_ids and not config.record_only:
        state.timelines = Timelines(config.continuity_episodes, config.continuity_tokens,
                                    reasoning_history=config.reasoning_history)
        state.parsing = reply_parsing(config.tool_parser, config.reasoning_parser, config.tokenizer)
        state.timelines.forced_tools = state.parsing.forced_tools
    app[RESPONSES] = ConversationStore()
    app[ENGINES] = Engines(config.engine_bases)
    app.cleanup_ctx.append(_resources)
    for prefix in ("/v1", "/e/{episode}/v1"):
        app.router.add_post(prefix + "/chat/completions", chat_completions)
        app.router.add_post(prefix + "/completions", completions)
        app.router.add_get(prefix + "/models", models)
        app.router.add_post(prefix + "/responses", responses)
        app.router.add_post(prefix + "/messages", messages)
    for prefix in ("", "/e/{episode}"):  # Azure OpenAI's deployment URLs, where AzureOpenAI sends chat calls
        app.router.add_post(prefix + "/openai/deployments/{deployment}/chat/completions", chat_completions)
        app.router.add_post(prefix + "/openai/deployments/{deployment}/completions", completions)
    for prefix in ("/v1", "/e/{episode}/v1"):  # after every route above: what the proxy does not serve itself
        app.router.add_get(prefix + "/{tail:.+}", passthrough)
        app.router.add_post(prefix + "/{tail:.+}", passthrough)
    app.router.add_get("/health", health)
    app.router.add_get("/openapi.json", openapi_description)
    add_admin_routes(app)
    return app


def public_config(config: ProxyConfig) -> dict:
    """The config as stored with the run: never a token."""
    out = dataclasses.asdict(config)
    for secret in ("auth_token", "admin_token"):
        out.pop(secret, None)
    return orjson.loads(orjson.dumps(out, default=str))


async def _resources(app: web.Application):
    config, state = app[CONFIG], app[STATE]
    store = Store.open(config.db_path, memory_mb=config.db_memory_mb)
    store.start_run(state.run_id, public_config(config), __version__)
    recorder = Recorder(store, max_batch=config.record_batch, max_delay_s=config.record_delay_s)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s)
    session = aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),  # no agent gets cookies an upstream set for another (and no filtering)
    )

    app[STORE], app[RECORDER], app[SESSION] = store, recorder, session
    app[ENGINE_CLIENT] = EngineClient(connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.read_timeout_s)
    app[EPISODES] = Episodes(state.run_id, auto_open=config.auto_episodes, store=store, recorder=recorder,
                             max_states=config.max_episodes, guard_ends=config.guard.end_episode)
    if not config.record_only:
        served, state.max_model_len = await _discover_model(session, config, quiet=state.served_model is not None)
        state.served_model = state.served_model or served
    try:
        yield
    finally:
        app[ENGINE_CLIENT].close()
        await session.close()
        recorder.close()
        store.end_run(state.run_id)
        store.close()


async def _discover_model(session: aiohttp.ClientSession, config: ProxyConfig, *,
                          quiet: bool) -> tuple[str | None, int | None]:
    """The model the engine serves and its context (vLLM's `max_model_len`), as its /v1/models says; None for what
    it does not say. `quiet`: the model name is known already, so an engine not up yet is not worth a warning."""
    url = config.upstream_base + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            card = (await resp.json())["data"][0]
        length = card.get("max_model_len")
        return card["id"], length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
    except Exception as exc:  # the engine may come up later; calls then keep the model name they asked for
        if not quiet:
            log.warning("could not ask %s which model it serves (%s); requests keep the model name they send", url,
                        exc)
        return None, None


# ---------------------------------------------------------------------------------------------------------------
# The OpenAI surface.
# ---------------------------------------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _llm_call(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _llm_call(request, COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    """The OpenAI Responses API, served as a chat call (proxy/wire/responses.py)."""
    return await _llm_call(request, CHAT, ResponsesWire(request.app[RESPONSES], request.app[CONFIG].hosted_tools))


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages, served as a chat call (proxy/wire/messages.py); errors in Anthropic's shape."""
    wire = MessagesWire()
    try:
        return await _llm_call(request, CHAT, wire)
    except ApiError as exc:
        return wire.error_response(exc)


async def _llm_call(request: web.Request, endpoint: str, wire: Wire | None = None) -> web.StreamResponse:
    episodes = request.app[EPISODES]
    api_key = request_key(request)
    check_agent_auth(request, api_key)
    if full := request.app[RECORDER].disk_full:
        raise ApiError(503, f"the proxy cannot record calls: no space left for {request.app[CONFIG].db_path} "
                       f"({full}). Free space there: calls are taken again once the calls waiting are written",
                       code="storage_full")
    episode_id = await episodes.resolve(request.match_info.get("episode"), api_key)
    raw = await read_body(request)
    call_index = await episodes.start_call(episode_id)
    try:
        fwd = forwarded(request, api_key)
        if wire is not None and not wire.forwards_query:
            fwd = dataclasses.replace(fwd, query="")
        return await _numbered_call(request, endpoint, wire, episode_id, call_index, raw, fwd)
    finally:
        episodes.end_call(episode_id)


async def _numbered_call(request: web.Request, endpoint: str, wire: Wire | None, episode_id: str, call_index: int,
                         raw: bytes, fwd: Forwarded) -> web.StreamResponse:
    """One call with its place in its episode: forwarded (to another engine if its own is down) and recorded.
    `fwd`: in record-only mode, what of the agent's request goes upstream besides its body (proxy/record_only.py)."""
    app = request.app
    state = app[STATE]
    where = {"run_id": state.run_id, "episode_id": episode_id, "call_index": call_index,
             "weight_version": state.weight_version}
    if (refusal := _refusal(app, episode_id, call_index)) is not None:
        flag, exc = refusal
        call = refused_call(endpoint, exc, wire, **where)
        call.extra["flags"] = [flag]
        app[RECORDER].record_call(call)
        raise exc
    try:
        prepared, role = _prepare(request, endpoint, wire, raw, _call_seed(state, episode_id, call_index))
    except ApiError as exc:
        app[RECORDER].record_call(refused_call(endpoint, exc, wire, **where))
        raise
    frozen = role is not None and role.upstream is not None
    engines, moved_from = app[ENGINES], []
    while True:  # once, unless the engine cannot be reached and another can take the call
        base = None if frozen else engines.pick(episode_id)
        cap, url, answer, hashes = await _plan_call(app, prepared, episode_id, call_index, endpoint, role, base, fwd)
        if wire is not None and wire.notes:  # what the translation left out (a Responses call's hosted tools)
            cap.notes.update(wire.notes)
        if moved_from:
            cap.notes["engine_failover"] = moved_from
        if base is not None:
            engines.in_flight[base] += 1
        try:
            resp = await forward(request, _client(app, base, url), url, cap, answer, wire)
        except asyncio.CancelledError:
            if not cap.done_sent:  # cancelled after the whole stream went out (e.g. at shutdown): the answer is whole
                cap.fail(CANCELLED, 0, "the agent disconnected before the answer was complete")
            _record(app, cap, prepared, hashes, base)
            raise
        except BaseException as exc:  # a bug of ours: the call is recorded as failed, never as ok
            if not cap.done_sent:
                cap.fail(ERROR, 500, f"the proxy failed: {exc!r}")
            _record(app, cap, prepared, hashes, base)
            raise
        finally:
            if base is not None:
                engines.in_flight[base] -= 1
        if base is not None and not engines.single and await _engine_failed(app, cap, base) \
                and engines.mark_down(base, cap.error):
            moved_from.append(base)  # nothing reached the agent yet: the call goes to another engine
            continue
        _record(app, cap, prepared, hashes, base)
        return resp


def _prepare(request: web.Request, endpoint: str, wire: Wire | None, raw: bytes,
             seed: int | None) -> tuple[Prepared, RoleRule | None]:
    """The request parsed (once), checked, and made what its upstream gets, with its role: our engine's request,
    or the agent's as sent for a frozen role's server (its own sampling) and for the API recorded in record-only
    mode. Our engine gets it under the model name of the role's policy (proxy/roles.py). An Azure deployment URL
    names the model when the body does not (AzureOpenAI sends both; a bare request may send only the URL's);
    another API's request becomes a chat request: either is stored as it serialises, any other request as the
    agent sent it."""
    config, state = request.app[CONFIG], request.app[STATE]
    body = parse_json_object(raw)
    if wire is not None:
        body, raw = wire.translate(body), None
    elif (deployment := request.match_info.get("deployment")) is not None and "model" not in body:
        body, raw = {"model": deployment, **body}, None
    agent = read_request(endpoint, body, raw)
    role = find_role(config.roles, agent.requested_model, agent.body, agent.role_key)
    if role is not None and role.upstream is not None:
        return as_sent(agent, role.upstream_model), role
    if config.record_only:
        return as_sent(agent, None), role
    return for_engine(agent, config, state.engine_model(policy_of(role)), state.sampling, seed=seed,
                      max_model_len=state.max_model_len), role


async def _plan_call(app: web.Application, prepared: Prepared, episode_id: str, call_index: int, endpoint: str,
                     role: RoleRule | None, base: str | None, fwd: Forwarded):
    """Where one attempt of a call goes (`base`: the policy engine chosen; None: a frozen role's upstream) and how:
    the capture, the URL, and for token-exact continuity the completions answer and the prefix hashes."""
    state = app[STATE]
    cap = Capture(prepared, run_id=state.run_id, episode_id=episode_id, call_index=call_index,
                  weight_version=state.version_of(policy_of(role)) if base is not None else state.weight_version)
    cap.on_complete = app[RECORDER].journal_call  # a stream's record is journaled before its last bytes go out
    route = "chat/completions" if endpoint == CHAT else "completions"
    if role is not None:
        cap.role = cap.notes["role"] = role.name  # the note too: SQL written before calls.role reads it
    if base is None:
        url, cap.notes["upstream"] = role.upstream_url(route), role.upstream
        key = os.environ.get(role.upstream_key_env) if role.upstream_key_env else None
        if key:
            cap.upstream_headers["Authorization"] = f"Bearer {key}"
        cap.upstream_body = orjson.dumps(prepared.body)
        return cap, url, None, None
    url = f"{base}/v1/{route}"
    if app[CONFIG].record_only:  # not our engine: the agent's key and query string go along, nothing of ours
        if fwd.deployment is not None:  # an Azure deployment URL goes to the same path on the upstream's host
            url = f"{URL(base).origin()}/openai/deployments/{quote(fwd.deployment, safe='')}/{route}"
        cap.upstream_headers.update(fwd.headers)
        cap.upstream_query = fwd.query
    else:
        cap.upstream_headers[EPISODE_HEADER] = episode_id
        cap.policy = policy_of(role)
    if not app[ENGINES].single:
        cap.notes["engine"] = base
    answer, hashes, send = None, None, prepared.body
    if endpoint == CHAT and state.timelines is not None:
        body = prepared.body
        hashes = prefix_hashes(body)
        how = await plan(state.timelines, episode_id, body, hashes, _client(app, base, base), base)
        cap.continuity = how.record()
        if how.prompt_ids is not None:
            parsing = state.parsing.request(body)
            send, url = completions_body(body, how, parsing), f"{base}/v1/completions"
            answer = ChatAnswer(parsing, int(body.get("top_logprobs") or 0),
                                parallel_tool_calls=body.get("parallel_tool_calls") is not False)
    cap.upstream_body = orjson.dumps(send)
    return cap, url, answer, hashes


def _client(app: web.Application, base: str | None, url: str):
    """The policy engine's own calls go by the lean client (proxy/engine_client.py); a frozen role's upstream and
    record-only mode's API (any scheme, the agent's own headers) by aiohttp."""
    if base is not None and not app[CONFIG].record_only and EngineClient.serves(url):
        return app[ENGINE_CLIENT]
    return app[SESSION]


async def _engine_failed(app: web.Application, cap: Capture, base: str) -> bool:
    """The call failed because its engine is gone (not because of the request), before the agent got anything."""
    if cap.unreachable:
        return True
    return cap.status == ERROR and cap.http_status in (502, 503, 504) and not await healthy(app[SESSION], base)


_NO_GUARD = GuardConfig()


def _refusal(app: web.Application, episode_id: str, call_index: int) -> tuple[dict, ApiError] | None:
    """Why a call of an episode that has ended is refused (its flag, its 400), or None: the call goes ahead. The
    default episode (calls that name none) is not an episode of one agent: it is never limited."""
    limit = app[CONFIG].max_turns
    if episode_id == app[EPISODES].default_id:
        return None
    if limit is not None and call_index >= limit:
        flag, why = ended_flag("max_turns", call_index + 1, limit), f"it made its max_turns {limit} calls"
    elif (ended := app[EPISODES].ended(episode_id)) is not None:
        flag, why = ended_flag(ended[0]), ended[1]
    else:
        return None
    return flag, ApiError(400, f"episode {episode_id!r} has ended: {why}. The proxy refuses its later calls; start "
                          "a new episode for new work", code="episode_ended")


def _record(app: web.Application, cap: Capture, prepared: Prepared, hashes, base: str | None) -> None:
    config, state = app[CONFIG], app[STATE]
    call = cap.to_call()
    guard = config.guard if base is not None else _NO_GUARD  # a frozen role's fixed model is not the policy
    try:
        flags = flags_of(call, max_tokens_of(prepared.body), guard)
        if state.parsing is not None and base is not None and prepared.endpoint == CHAT:
            flags += state.parsing.flags(prepared.body, call)
    except Exception:  # a bug of ours costs the call its flags, never the call
        log.exception("could not flag call %s of episode %s", call.call_index, call.episode_id)
        flags = []
    if flags:
        call.extra["flags"] = flags
        if guard.end_episode and (reason := degenerate(flags)):
            app[EPISODES].end(call.episode_id, "guard", ended_why(call.call_index, reason))
    policy = call.policy or DEFAULT_POLICY
    version = state.version_of(policy)
    if (base is not None and call.weight_version != version  # new weights under the same name
            and prepared.body.get("model") in (state.engine_model(policy), None)):
        call.extra["weights_changed_to"] = version  # its later tokens may come from them
    app[RECORDER].record_call(call)
    if hashes is not None and call.status == OK:
        # Once the answer has left (it goes out in this loop turn, right after this): its agent's next call can only
        # come after it, and is read in a later turn, after this runs.
        asyncio.get_running_loop().call_soon(state.timelines.remember, call, prepared.body, hashes)
    if (call.token_source == NONE and call.status == OK and config.returns_token_ids and not state.warned_no_ids
            and base is not None):
        state.warned_no_ids = True
        log.warning("the engine at %s returned no token ids: this run records text only", base)


def _call_seed(state: RunState, episode_id: str, call_index: int) -> int | None:
    """With a sampling seed set, each call's own seed: from the seed, the episode id without this proxy run's
    prefix (a trainer's episode ids start with it) and the call index, so a restarted run seeds the same calls
    the same way."""
    base = state.sampling.seed if state.sampling is not None else None
    if base is None:
        return None
    key = f"{base}\0{episode_id.removeprefix(state.run_id)}\0{call_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big") & 0x7FFFFFFF


async def health(request: web.Request) -> web.Response:
    state, recorder = request.app[STATE], request.app[RECORDER]
    return json_response({"status": "ok", "run_id": state.run_id, "served_model": state.served_model,
                          "pending_records": recorder.pending})


async def openapi_description(request: web.Request) -> web.Response:
    return web.Response(body=_OPENAPI, content_type="application/json")


_OPENAPI = orjson.dumps(openapi())
