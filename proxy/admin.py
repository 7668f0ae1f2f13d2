"""The proxy's admin surface (/harness/...): read-only SQL over the live store, opening episodes, the weight version,
status. Every route needs the admin token: `Authorization: Bearer <admin_token>`."""

from __future__ import annotations

import asyncio

import duckdb
from aiohttp import web

from harness.store.readonly import ReadOnlyError, check_read_only
from proxy.http_json import ApiError, dumps_values, json_response, parse_json_object, read_body
from proxy.roles import DEFAULT_POLICY, is_policy_name, policy_names
from proxy.state import CONFIG, EPISODES, RECORDER, STATE, STORE, RunState, request_key


def add_admin_routes(app: web.Application) -> None:
    app.router.add_post("/harness/sql", sql)
    app.router.add_post("/harness/episodes", open_episode)
    app.router.add_post("/harness/weights", set_weight_version)
    app.router.add_get("/harness/status", status)


def _check_admin(request: web.Request) -> None:
    if request_key(request) != request.app[CONFIG].admin_token:
        raise ApiError(401, "admin routes need the admin token (Authorization: Bearer <admin_token>); "
                       "`harness sql` finds it in the run's proxy.json", code="invalid_admin_token")


async def _json_body(request: web.Request) -> dict:
    return parse_json_object(await read_body(request))


async def sql(request: web.Request) -> web.Response:
    """Read-only SQL over the live store; everything recorded so far is flushed first."""
    _check_admin(request)
    body = await _json_body(request)
    query, params, max_rows = body.get("sql"), body.get("params"), body.get("max_rows")
    if not isinstance(query, str):
        raise ApiError(400, f"'sql' must be a string, got {type(query).__name__}", param="sql")
    if params is not None and not isinstance(params, list):
        raise ApiError(400, f"'params' must be a list of values for the ? placeholders, got {type(params).__name__}",
                       param="params")
    if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool)
                                 or not 0 <= max_rows <= 10**9):
        raise ApiError(400, f"'max_rows' must be a non-negative integer, got {max_rows!r}", param="max_rows")
    try:
        check_read_only(query)
    except ReadOnlyError as exc:
        raise ApiError(403, str(exc), code="read_only") from None
    except (ValueError, duckdb.Error) as exc:
        raise ApiError(400, f"SQL error: {exc}", code="sql_error") from None
    if not request.app[RECORDER].disk_full:  # a full disk holds the newest calls back: what is written is read
        await asyncio.to_thread(request.app[RECORDER].flush)
    try:
        result = await asyncio.to_thread(request.app[STORE].query, query, params, max_rows=max_rows)
    except ReadOnlyError as exc:  # a file outside the store
        raise ApiError(403, str(exc), code="read_only") from None
    except duckdb.Error as exc:
        raise ApiError(400, f"SQL error: {exc}", code="sql_error") from None
    payload = {"columns": result.columns, "types": result.types, "rows": result.rows, "truncated": result.truncated}
    return web.Response(body=dumps_values(payload), content_type="application/json")


async def open_episode(request: web.Request) -> web.Response:
    _check_admin(request)
    body = await _json_body(request)
    episode_id, meta = body.get("episode_id"), body.get("meta") or {}
    if episode_id is not None and not isinstance(episode_id, str):
        raise ApiError(400, f"'episode_id' must be a string, got {type(episode_id).__name__}", param="episode_id")
    if not isinstance(meta, dict):
        raise ApiError(400, f"'meta' must be an object, got {type(meta).__name__}", param="meta")
    return json_response(await request.app[EPISODES].open(episode_id, meta=meta))


async def set_weight_version(request: web.Request) -> web.Response:
    """The weight version stamped on calls from now on, and with LoRA the engine's name for the new adapter: of the
    default policy, or with "policy" of that policy (one adapter per trained role), whose calls go to it and are
    stamped with this version from now on (each policy's adapter is pushed on its own)."""
    _check_admin(request)
    body = await _json_body(request)
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**31:
        raise ApiError(400, f"'version' must be an integer from 0 to 2**31-1 (calls.weight_version is an INTEGER), "
                       f"got {version!r}", param="version")
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and 0 < len(model) <= 256):
        raise ApiError(400, f"'model' must be the engine's name for the new policy (1-256 characters), got "
                       f"{model!r}", param="model")
    policy = body.get("policy")
    if policy is not None:
        _check_policy(request, policy, model)
    state = request.app[STATE]
    if policy is None or policy == DEFAULT_POLICY:
        state.weight_version = version
        if model is not None:  # LoRA: each version is served under a name of its own (trainer/model/weight_sync.py)
            state.served_model = model
    else:  # that policy's calls go to its new adapter, stamped with its version; the others' stay as they are
        state.policy_models[policy], state.policy_versions[policy] = model, version
    return json_response({"weight_version": version, "served_model": state.served_model,
                          "policy_models": _policy_models(request, state)})


def _check_policy(request: web.Request, policy: object, model: str | None) -> None:
    if not (is_policy_name(policy) and len(policy) <= 256):
        raise ApiError(400, f"'policy' must be a policy name (1-256 letters, digits, '_', '-' or '.'), got "
                       f"{policy!r}", param="policy")
    if model is None:
        raise ApiError(400, f"'model' is required with 'policy': the engine's name for policy {policy!r}'s new "
                       "adapter, e.g. {\"version\": 3, \"policy\": \"planner\", \"model\": \"planner-v000003\"}",
                       param="model")
    known = policy_names(request.app[CONFIG].roles)
    if policy not in known:
        raise ApiError(400, f"'policy' {policy!r} serves no role of this proxy, whose policies are "
                       f"{', '.join(map(repr, known))}: give the role rule that policy (RoleRule.policy), or name "
                       "one of these", param="policy")


def _policy_models(request: web.Request, state: RunState) -> dict[str, str | None]:
    """Every policy of the proxy's roles, with the engine's model name its calls go to now."""
    return {policy: state.engine_model(policy) for policy in policy_names(request.app[CONFIG].roles)}


async def status(request: web.Request) -> web.Response:
    _check_admin(request)
    state, recorder, episodes = request.app[STATE], request.app[RECORDER], request.app[EPISODES]
    return json_response({
        "run_id": state.run_id, "served_model": state.served_model, "weight_version": state.weight_version,
        "policy_models": _policy_models(request, state),
        "calls_written": recorder.calls_written, "calls_spilled": recorder.calls_spilled,
        "pending_records": recorder.pending, "last_error": recorder.last_error and str(recorder.last_error),
        "episodes_in_memory": len(episodes), "episodes_forgotten": episodes.evicted, "disk_full": recorder.disk_full,
        "forwarded": state.forwarded,
    })
