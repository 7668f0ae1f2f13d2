"""`harness view`: a local web page over the recorded rollouts, straight from the DuckDB store.

One small aiohttp server on 127.0.0.1: the page (harness/viewer/static/: plain HTML, JS and CSS, nothing to build,
nothing fetched from the network) and a JSON API, every answer one read-only, parameterised query through
`harness.store.sql.run_sql`. So it works on a closed file, on a folder of files, and on a file a live proxy or training
run holds (the query then goes through that proxy): the page polls, and new steps appear.

    GET  /api/runs                          runs, newest first
    GET  /api/runs/{run}/curves             per-step reward, pass@k, KL, entropy, length, drift, merge ratio
    GET  /api/runs/{run}/episodes?...       filtered, sorted, paged episodes with facets
    GET  /api/episodes/{episode}            calls, merged samples token by token, merge breaks
    POST /api/sql                           {"sql": "..."}: read-only SQL, results as a table

A training run's steps are runs of their own in episode_outcomes (`<run>-train00003`, `<run>-val00003`): the step
is read off that suffix.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import math
import os
import sys
import threading
from pathlib import Path

import orjson
import yaml
from aiohttp import web

from harness.store.sql import Reader, SqlError, run_sql
from proxy.http_json import ApiError, dumps_values, error_body, json_response

log = logging.getLogger("harness.view")
STATIC = Path(__file__).with_name("static")
PAGE_SIZE = 100
_SORTS = {"reward": "reward", "started_at": "started_at", "task_id": "task_id", "n_calls": "n_calls",
          "duration_ms": "duration_ms", "step": "step", "status": "status"}
_CURVES = ("reward_mean", "val_pass_at_n", "kl", "entropy", "response_length")
# the update: sample tokens per position computed (trainer.layout), its time; the engine/trainer mismatch and the
# share of tokens the off-policy correction rejected (trainer.correction)
_UPDATE = ("computed_ratio", "update_s", "mismatch_kl", "rejected_share")
# With several policies (roles.policies), each one's curves: its metric name under policy/<name>/, and the label
_PER_POLICY = {"reward/mean": "reward", "actor/kl": "kl", "actor/entropy": "entropy", "actor/grad_norm": "grad norm",
               "advantage/abs_mean": "|advantage|", "update/tokens": "tokens trained"}
# Episodes with their step and kind read off the run id, reward, calls and roles; {where} filters episode_outcomes.
_EPISODES = """
    WITH per_call AS (
        SELECT episode_id, count(*) AS n_calls,
               list(DISTINCT extra->>'role') FILTER (WHERE extra->>'role' IS NOT NULL) AS roles
        FROM calls GROUP BY episode_id),
    judged AS (SELECT episode_id, reward FROM rewards)
    SELECT o.episode_id, o.run_id,
           TRY_CAST(nullif(regexp_extract(o.run_id, '-(train|val|verl)(\\d+)$', 2), '') AS INTEGER) AS step,
           nullif(regexp_extract(o.run_id, '-(train|val|verl)(\\d+)$', 1), '') AS kind,
           o.task_id, o.repeat_index, o.status, o.error, j.reward, coalesce(c.n_calls, 0) AS n_calls,
           o.duration_ms, o.started_at, coalesce(c.roles, []) AS roles
    FROM episode_outcomes AS o LEFT JOIN judged AS j USING (episode_id) LEFT JOIN per_call AS c USING (episode_id)
    WHERE {where}
"""
_OF_RUN = "o.run_id = ? OR starts_with(o.run_id, ? || '-')"  # a run's own episodes and its steps' (<run>-train00003)


class Viewer:
    """The API over one database file or folder (`harness.store.sql.run_sql` decides how to reach it)."""

    def __init__(self, db: Path, tokenizer_dir: Path | None = None):
        self.db = db
        self.tokenizer = _load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        self._local = threading.local()  # the Reader of the API call this thread is answering

    def answer(self, method: str, *args) -> dict:
        """One API call, its queries on one opening of the database (handlers run in threads)."""
        with Reader(self.db) as reader:
            self._local.reader = reader
            try:
                return getattr(self, method)(*args)
            finally:
                self._local.reader = None

    def query(self, sql: str, params: list | None = None, max_rows: int | None = None) -> list[dict]:
        reader = getattr(self._local, "reader", None)
        result = reader.query(sql, params, max_rows=max_rows) if reader else run_sql(self.db, sql, params,
                                                                                       max_rows=max_rows)
        return [dict(zip(result.columns, row, strict=True)) for row in result.rows]

    # ---- the API ----------------------------------------------------------------------------------------------
    def runs(self) -> dict:
        rows = self.query("""
            WITH outcomes AS (SELECT r.run_id, count(o.episode_id) AS episodes, avg(w.reward) AS mean_reward
                              FROM runs r LEFT JOIN episode_outcomes o
                                ON o.run_id = r.run_id OR starts_with(o.run_id, r.run_id || '-')
                              LEFT JOIN rewards w ON w.episode_id = o.episode_id GROUP BY r.run_id),
                 per_run AS (SELECT run_id, count(*) AS calls FROM calls GROUP BY run_id),
                 steps AS (SELECT run_id, max(step) AS steps FROM metrics GROUP BY run_id)
            SELECT r.run_id, r.started_at, r.ended_at, coalesce(o.episodes, 0) AS episodes,
                   coalesce(c.calls, 0) AS calls, s.steps, o.mean_reward
            FROM runs r LEFT JOIN outcomes o USING (run_id) LEFT JOIN per_run c USING (run_id)
            LEFT JOIN steps s USING (run_id) ORDER BY r.started_at DESC""")
        return {"runs": rows}

    def curves(self, run_id: str) -> dict:
        curve = self.query(f"SELECT step, {', '.join(_CURVES)} FROM training_curve WHERE run_id = ? ORDER BY step",
                           [run_id])
        merges = self.query("""
            SELECT TRY_CAST(regexp_extract(o.run_id, '-train(\\d+)$', 1) AS INTEGER) AS step,
                   CAST(sum(m.per_call_tokens) AS DOUBLE) / nullif(sum(m.merged_tokens), 0) AS merge_ratio,
                   CAST(sum(m.n_drift) AS DOUBLE) / nullif(sum(m.n_followups), 0) AS drift_rate
            FROM episode_merges m JOIN episode_outcomes o USING (episode_id)
            WHERE starts_with(o.run_id, ? || '-train') GROUP BY 1""", [run_id])
        update = self.query("""
            SELECT step, arg_max(value, created_at) FILTER (WHERE name = 'update/computed_ratio') AS computed_ratio,
                   arg_max(value, created_at) FILTER (WHERE name = 'time/train_s') AS update_s,
                   arg_max(value, created_at) FILTER (WHERE name = 'rollout_corr/kl') AS mismatch_kl,
                   arg_max(value, created_at) FILTER (WHERE name = 'rollout_corr/rollout_rs_masked_fraction')
                       AS rejected_share
            FROM metrics WHERE run_id = ? GROUP BY step""", [run_id])
        by_step = {r["step"]: r for r in merges if r["step"] is not None}
        steps = sorted({r["step"] for r in curve} | set(by_step))
        updates = {u["step"]: u for u in update}
        at = {r["step"]: {**r, **updates.get(r["step"], {})} for r in curve}
        series = {name: [(at.get(s) or {}).get(name) for s in steps] for name in (*_CURVES, *_UPDATE)}
        for name in ("drift_rate", "merge_ratio"):
            series[name] = [(by_step.get(s) or {}).get(name) for s in steps]
        per_policy: dict[str, dict[int, float]] = {}
        for r in self.query("SELECT step, name, arg_max(value, created_at) AS value FROM metrics WHERE run_id = ? "
                            "AND starts_with(name, 'policy/') GROUP BY step, name", [run_id]):
            policy, _, metric = r["name"].removeprefix("policy/").partition("/")
            if metric in _PER_POLICY:
                per_policy.setdefault(f"{policy}: {_PER_POLICY[metric]}", {})[r["step"]] = r["value"]
        for name in sorted(per_policy):
            series[name] = [per_policy[name].get(s) for s in steps]
        return {"steps": steps, "series": series}

    def episodes(self, run_id: str, args) -> dict:
        where, params = [], [run_id, run_id]
        if args.get("step"):
            where.append("step = ?")
            params.append(_int(args["step"], "step"))
        if args.get("task"):
            where.append("contains(task_id, ?)")
            params.append(args["task"])
        if args.get("status"):
            where.append("status = ?")
            params.append(args["status"])
        if args.get("role"):
            where.append("list_contains(roles, ?)")
            params.append(args["role"])
        for key, op in (("min_reward", ">="), ("max_reward", "<=")):
            if args.get(key):
                where.append(f"reward {op} ?")
                params.append(_number(args[key], key))
        sort = _SORTS.get(args.get("sort") or "started_at")
        if sort is None:
            raise ApiError(400, f"sort {args.get('sort')!r} is not one of {', '.join(_SORTS)}",
                           code="invalid_value", param="sort")
        order = "ASC" if (args.get("order") or "desc").lower() == "asc" else "DESC"
        limit = min(_int(args.get("limit") or PAGE_SIZE, "limit"), 1000)
        offset = _int(args.get("offset") or 0, "offset")
        filtered = f"SELECT * FROM ({_EPISODES.format(where=_OF_RUN)}) WHERE {' AND '.join(where) or 'true'}"
        rows = self.query(f"SELECT *, count(*) OVER () AS total FROM ({filtered}) "
                          f"ORDER BY {sort} {order} NULLS LAST, episode_id LIMIT ? OFFSET ?",
                          [*params, limit, offset])
        total = rows[0].pop("total") if rows else self.query(f"SELECT count(*) AS n FROM ({filtered})", params)[0]["n"]
        for row in rows[1:]:
            row.pop("total")
        facets = self.query(f"""SELECT list(DISTINCT step ORDER BY step) FILTER (WHERE step IS NOT NULL) AS steps,
                                       list(DISTINCT status ORDER BY status) AS statuses,
                                       flatten(list(roles)) AS roles FROM ({_EPISODES.format(where=_OF_RUN)})""",
                            [run_id, run_id])[0]
        facets = {"steps": facets["steps"] or [], "statuses": facets["statuses"] or [],
                  "roles": sorted(set(facets["roles"] or ()))}
        return {"total": total, "episodes": rows, "facets": facets}

    def episode(self, episode_id: str) -> dict:
        found = self.query(f"""SELECT e.*, o.answer, w.details AS judge_details
                               FROM ({_EPISODES.format(where="o.episode_id = ?")}) e
                               JOIN episode_outcomes o USING (episode_id)
                               LEFT JOIN (SELECT episode_id, details FROM judgements QUALIFY row_number() OVER
                                          (PARTITION BY episode_id ORDER BY created_at DESC) = 1) w USING (episode_id)
                               """, [episode_id])
        calls = self.query("""
            SELECT c.call_id, c.call_index, c.status, c.http_status, c.started_at, c.latency_ms, c.requested_model,
                   c.extra->>'role' AS role, c.stream, c.request, c.response, c.extra->'continuity' AS continuity,
                   c.extra->'flags' AS flags,
                   c.error, list({'index': ch.choice_index, 'text': ch.text, 'tool_calls': ch.tool_calls,
                                  'finish_reason': ch.finish_reason} ORDER BY ch.choice_index)
                              FILTER (WHERE ch.call_id IS NOT NULL) AS choices
            FROM calls c LEFT JOIN choices ch USING (call_id) WHERE c.episode_id = ?
            GROUP BY ALL ORDER BY c.call_index""", [episode_id])
        if not found and not calls:
            raise ApiError(404, f"no episode {episode_id!r} in {self.db}", code="episode_not_found")
        for call in calls:
            for key in ("request", "response", "continuity", "flags"):
                call[key] = _json(call[key])
            for choice in call["choices"] or ():
                choice["tool_calls"] = _json(choice["tool_calls"])
        samples = self.query("""SELECT sample_id, sample_index, role_key, n_tokens, n_trainable, reward, token_ids,
                                       loss_mask, logprobs, truncation FROM samples WHERE episode_id = ?
                                QUALIFY row_number() OVER (PARTITION BY sample_index ORDER BY created_at DESC) = 1
                                ORDER BY sample_index""", [episode_id])
        for sample in samples:
            ids, mask, logprobs = sample.pop("token_ids"), sample.pop("loss_mask"), sample.pop("logprobs")
            texts = self._texts(ids)
            sample["tokens"] = [{"id": t, "text": x, "mask": m, "logprob": _finite(lp)}
                                for t, x, m, lp in zip(ids, texts, mask, logprobs, strict=True)]
        breaks = self.query("SELECT call_id, choice_index, reason, position FROM merge_breaks WHERE episode_id = ? "
                            "ORDER BY position NULLS LAST", [episode_id])
        episode = found[0] if found else {"episode_id": episode_id}
        episode["judge_details"] = _json(episode.get("judge_details"))
        return {"episode": episode, "calls": calls, "samples": samples, "breaks": breaks}

    def _texts(self, ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


# ---- the server -----------------------------------------------------------------------------------------------
VIEWER = web.AppKey("viewer", Viewer)


LOCAL_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})
LOCAL_ONLY = web.AppKey("local_only", bool)
AUTH_TOKEN = web.AppKey("auth_token", str)
TOKEN_COOKIE = "harness_view_token"


def create_app(viewer: Viewer, *, local_only: bool = True, auth_token: str | None = None) -> web.Application:
    """The page and its API. local_only: answer only requests addressed to this machine by name (a web page
    elsewhere cannot reach the API through DNS rebinding). auth_token: every request must carry it, as `?token=`
    (the page's address: the answer keeps it in a cookie for the page's own requests), that cookie, or
    `Authorization: Bearer`; `harness view` demands one beyond loopback, as `harness serve` does."""
    app = web.Application(middlewares=[_errors])
    app[VIEWER] = viewer
    app[LOCAL_ONLY] = local_only
    app[AUTH_TOKEN] = auth_token or ""
    app.router.add_get("/", _index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/runs", _runs)
    app.router.add_get("/api/runs/{run}/curves", _curves)
    app.router.add_get("/api/runs/{run}/episodes", _episodes)
    app.router.add_get("/api/episodes/{episode}", _episode)
    app.router.add_post("/api/sql", _sql)
    return app


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def _runs(request: web.Request) -> web.Response:
    return await _answer(request, "runs")


async def _curves(request: web.Request) -> web.Response:
    return await _answer(request, "curves", request.match_info["run"])


async def _episodes(request: web.Request) -> web.Response:
    return await _answer(request, "episodes", request.match_info["run"], request.query)


async def _episode(request: web.Request) -> web.Response:
    return await _answer(request, "episode", request.match_info["episode"])


async def _answer(request: web.Request, method: str, *args) -> web.Response:
    return _json_response(await asyncio.to_thread(request.app[VIEWER].answer, method, *args))


async def _sql(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        body = None
    if request.content_type != "application/json":  # a cross-site form cannot send this without asking first
        raise ApiError(415, "send the query as application/json", code="unsupported_content_type")
    if not isinstance(body, dict) or not isinstance(body.get("sql"), str):
        raise ApiError(400, 'the body must be {"sql": "SELECT ..."}', code="invalid_body", param="sql")
    result = await asyncio.to_thread(run_sql, request.app[VIEWER].db, body["sql"], max_rows=1000)
    return _json_response({"columns": result.columns, "types": result.types, "rows": result.rows,
                           "truncated": result.truncated})


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error as the proxy's OpenAI-style JSON (proxy/http_json.py), the same shape the page reads."""
    if request.app[LOCAL_ONLY] and (request.host or "").rsplit(":", 1)[0] not in LOCAL_NAMES:
        return ApiError(403, f"this viewer answers requests for 127.0.0.1 or localhost, not {request.host!r}",
                        code="host_not_allowed").response()
    token = request.app[AUTH_TOKEN]
    if token and not _carries(request, token):
        return ApiError(401, "this viewer needs its token: open the page as /?token=TOKEN (the --auth-token it was "
                        "started with), or send Authorization: Bearer TOKEN", code="invalid_token").response()
    try:
        response = await handler(request)
        if token and request.query.get("token"):  # the page's own requests carry it from here on
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict")
        return response
    except ApiError as exc:
        return exc.response()
    except SqlError as exc:
        return json_response(error_body(400, str(exc), code="invalid_sql", param="sql"), status=400)
    except web.HTTPException as exc:  # no such route or static file, wrong method
        if exc.status < 400:
            raise
        return json_response(error_body(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_")),
                             status=exc.status)


def _carries(request: web.Request, token: str) -> bool:
    """Whether the request carries the viewer's token (query, cookie or bearer), compared in constant time."""
    bearer = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    given = [request.query.get("token"), request.cookies.get(TOKEN_COOKIE), bearer]
    return any(value and hmac.compare_digest(value.encode(), token.encode()) for value in given)


def _json_response(obj) -> web.Response:
    return web.Response(body=dumps_values(obj), content_type="application/json")


def _json(value):
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _finite(x):
    return x if x is None or math.isfinite(x) else None


def _int(value, name: str) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        out = -1
    if out < 0:
        raise ApiError(400, f"{name} must be a non-negative integer, got {value!r}", code="invalid_value", param=name)
    return out


def _number(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"{name} must be a number, got {value!r}", code="invalid_value", param=name) from None


def _load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}: pass --tokenizer a model directory that has one")
    return Tokenizer.from_file(str(path))


def tokenizer_dir_for(db: Path) -> Path | None:
    """The model of the training run whose directory holds `db` (its config.resolved.yaml), if there is one."""
    folder = db if db.is_dir() else db.parent
    for candidate in (folder, *folder.parents[:2]):
        resolved = candidate / "config.resolved.yaml"
        if resolved.exists():
            try:
                path = (yaml.safe_load(resolved.read_text()) or {}).get("harness", {}).get("model", {}).get("path")
            except yaml.YAMLError:
                return None
            return Path(path) if path and (Path(path) / "tokenizer.json").exists() else None
    return None


# ---- harness view ---------------------------------------------------------------------------------------------
def add_parser(verbs) -> None:
    from harness.cli.options import port_number  # here: harness.cli imports this module

    p = verbs.add_parser(
        "view", help="a local web page over recorded rollouts: runs, curves, episodes token by token, SQL",
        description="Serve a page on 127.0.0.1 over a run's DuckDB file: runs, per-step curves, a filterable episode "
        "table, every call of an episode and its merged sequence token by token (loss mask, logprob heat map), a "
        "read-only SQL box. Works while a run is live: new steps appear.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", type=Path, default=Path("runs/harness.duckdb"),
                       help="DuckDB file, or a folder of them read as one (default: %(default)s)")
    where.add_argument("--run", type=Path, help="a run directory (its harness.duckdb; or, without one, every "
                       ".duckdb file under it, e.g. a backbone: verl run)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    p.add_argument("--port", type=port_number, default=8500, help="port (default: %(default)s; 0: any free port)")
    p.add_argument("--auth-token", default=os.environ.get("HARNESS_AUTH_TOKEN"),
                   help="token the page and API demand (open the page as /?token=TOKEN); required when binding "
                   "beyond loopback, as for harness serve (env HARNESS_AUTH_TOKEN)")
    p.add_argument("--tokenizer", type=Path, help="model directory whose tokenizer.json shows token text (default: "
                   "the model in the run's config.resolved.yaml, if any; else token ids)")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.cli.options import bind_failure

    db = args.db if args.run is None else (args.run / "harness.duckdb" if (args.run / "harness.duckdb").exists()
                                           else args.run)
    if not db.exists():
        print(f"error: no database at {str(db)!r}: record or train something first, or pass --db / --run",
              file=sys.stderr)
        return 2
    local = args.host in LOCAL_NAMES
    if problem := _start_error(db, args.host, args.port, args.auth_token, local):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    tokenizer = args.tokenizer or tokenizer_dir_for(db)
    try:
        viewer = Viewer(db, tokenizer)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = create_app(viewer, local_only=local, auth_token=args.auth_token)
    try:
        asyncio.run(_serve(app, args.host, args.port, db, tokenizer, bool(args.auth_token)))
    except OSError as exc:  # the port was taken since _start_error looked
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
        print(f"error: {bind_failure(args.host, args.port, exc)}", file=sys.stderr)
        return 2
    return 0


def _start_error(db: Path, host: str, port: int, auth_token: str | None, local: bool) -> str | None:
    """What would leave the page unusable, found before it is served: a page open beyond this machine without a
    token, a port in use, a file that is not a harness database (else the page starts and every answer fails)."""
    from harness.cli.options import listen_error

    if not local and not auth_token:
        return (f"binding to {host!r} exposes the recorded runs beyond this machine: set an auth token (--auth-token "
                "or HARNESS_AUTH_TOKEN), or bind to 127.0.0.1")
    if problem := listen_error(host, port):
        return problem
    try:
        with Reader(db) as reader:
            reader.query("SELECT count(*) FROM runs")
    except SqlError as exc:
        return f"harness view reads a harness database: {exc}"
    return None


async def _serve(app: web.Application, host: str, port: int, db: Path, tokenizer: Path | None,
                 with_token: bool) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    page = f"http://{host}:{bound}/" + ("?token=TOKEN (your --auth-token)" if with_token else "")
    print(f"harness view: {page} over {db}" + ("" if tokenizer else " (token ids only: pass "
          "--tokenizer for their text)"), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
