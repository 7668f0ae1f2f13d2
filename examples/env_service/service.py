"""A reference environment service: arithmetic tasks, one instance per episode, scored by the service itself.

It speaks the three routes of docs/environments.md and nothing else, and imports nothing of the harness: it stands
for a third-party environment (a sandbox, a game, a web shop) that you would write in any language.

    python examples/env_service/service.py --port 8600
    harness run examples/simple_agent.py --data http://127.0.0.1:8600 --judge env --model ...

The reference answers stay here: the agent sees the prompt only, and the harness learns the reward by asking.
"""

from __future__ import annotations

import argparse
import re
import uuid
from dataclasses import dataclass

from aiohttp import web

# (task_id, prompt, answer) per split. The ids are unique across splits: an instance is created by id alone.
TASKS: dict[str, list[tuple[str, str, float]]] = {
    "train": [
        ("add-17-25", "What is 17 plus 25?", 42),
        ("mul-6-7", "What is 6 times 7?", 42),
        ("sub-100-58", "What is 100 minus 58?", 42),
        ("div-84-4", "What is 84 divided by 4?", 21),
        ("add-neg", "What is -8 plus 3?", -5),
        ("mul-dec", "What is 2.5 times 4?", 10),
    ],
    "validation": [
        ("add-123-456", "What is 123 plus 456?", 579),
        ("mul-12-12", "What is 12 times 12?", 144),
        ("sub-7-19", "What is 7 minus 19?", -12),
    ],
}

# The last number in the answer: "-12", "1,234", "2.5"; thousands commas are allowed, a trailing period is not part.
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


@dataclass
class Instance:
    """One episode's copy of a task. Arithmetic has no state to keep, but a real environment would keep it here."""

    instance_id: str
    task_id: str
    prompt: str
    answer: float
    evaluations: int = 0  # how often it was scored (a judge may re-judge)


class ServiceError(Exception):
    """A request the service refuses; answered as {"error": message} with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


TASK_INDEX = web.AppKey("task_index", dict)  # task_id -> (split, prompt, answer)
INSTANCES = web.AppKey("instances", dict)  # instance_id -> Instance


def create_app() -> web.Application:
    """The service as an aiohttp app, for `web.run_app` or for tests that run it in-process."""
    app = web.Application(middlewares=[_errors_as_json])
    app[TASK_INDEX] = {tid: (split, prompt, answer) for split, rows in TASKS.items() for tid, prompt, answer in rows}
    app[INSTANCES] = {}
    app.router.add_get("/tasks", list_tasks)
    app.router.add_post("/instances", create_instance)
    app.router.add_post("/instances/{instance_id}/evaluate", evaluate)
    return app


async def list_tasks(request: web.Request) -> web.Response:
    """GET /tasks?split=train -> {"tasks": [{"task_id", "prompt"}]}; the answers are not listed."""
    split = request.query.get("split", "train")
    if split not in TASKS:
        raise ServiceError(404, f"no split {split!r}; this service has: {', '.join(TASKS)}")
    return web.json_response({"tasks": [{"task_id": tid, "prompt": prompt} for tid, prompt, _ in TASKS[split]]})


async def create_instance(request: web.Request) -> web.Response:
    """POST /instances {"task_id"} -> {"instance_id", "task": {"task_id", "prompt"}}."""
    body = await _json_object(request)
    task_id = body.get("task_id")
    if not isinstance(task_id, str) or task_id not in request.app[TASK_INDEX]:
        raise ServiceError(404, f"no task {task_id!r}; GET /tasks?split=... lists them")
    _, prompt, answer = request.app[TASK_INDEX][task_id]
    instance = Instance(instance_id=uuid.uuid4().hex, task_id=task_id, prompt=prompt, answer=answer)
    request.app[INSTANCES][instance.instance_id] = instance
    return web.json_response({"instance_id": instance.instance_id, "task": {"task_id": task_id, "prompt": prompt}},
                             status=201)


async def evaluate(request: web.Request) -> web.Response:
    """POST /instances/{id}/evaluate {"answer"} -> {"reward": 1.0 or 0.0, "details": {"expected", "got", ...}}."""
    instance = request.app[INSTANCES].get(request.match_info["instance_id"])
    if instance is None:
        raise ServiceError(404, f"no instance {request.match_info['instance_id']!r}; create one with POST /instances")
    answer = (await _json_object(request)).get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ServiceError(400, f"\"answer\" must be a string or null, got {type(answer).__name__}")
    got = last_number(answer or "")
    instance.evaluations += 1
    correct = got is not None and abs(got - instance.answer) < 1e-9
    details = {"task_id": instance.task_id, "expected": instance.answer, "got": got,
               "evaluations": instance.evaluations}
    if got is None:
        details["reason"] = "no number in the answer"
    return web.json_response({"reward": 1.0 if correct else 0.0, "details": details})


def last_number(text: str) -> float | None:
    """The last number written in `text`, or None: agents explain before they answer."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


# ---------------------------------------------------------------------------------------------------------------


async def _json_object(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise ServiceError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ServiceError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    """Every error, unknown routes and wrong methods included, answers in the protocol's shape: {"error": "..."}."""
    try:
        return await handler(request)
    except ServiceError as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"error": f"{request.method} {request.path}: {exc.reason}"}, status=exc.status)


def main() -> None:
    parser = argparse.ArgumentParser(description="A reference environment service with arithmetic tasks.")
    parser.add_argument("--port", type=int, default=8600, help="port on 127.0.0.1 (default: %(default)s)")
    args = parser.parse_args()
    print(f"environment service on http://127.0.0.1:{args.port}  (try: GET /tasks?split=train)", flush=True)
    web.run_app(create_app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
