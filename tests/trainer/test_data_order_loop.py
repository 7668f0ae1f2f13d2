"""A run whose dataset is not a multiple of its batch crosses every epoch boundary: 3 tasks in batches of 2 over 24
steps of the real loop (proxy, agents, judge, trainer, weight pushes) against the scripted engine, the second half
a resume from the checkpoint of step 12. No step holds a task twice, so no episode id repeats (a repeated task used
to give two episodes one id and kill the run at its first boundary: `Duplicate key "episode_id: ...-t2-0"`), every
pass covers the three tasks, and `trainer.keep_checkpoints` keeps the newest checkpoint only."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import ScriptedUpstream, db_rows
from trainer.config import load_config

TERSE = Path(__file__).resolve().parents[2] / "examples" / "terse_agent"
AGENT = """import json, os, urllib.request
task = json.loads(os.environ["HARNESS_TASK"])
body = {"model": "policy", "messages": [{"role": "user", "content": task["prompt"]}], "max_tokens": 8}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
answer = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]["content"]
print(json.dumps({"answer": answer}))
"""


def test_three_tasks_in_batches_of_two_over_24_steps_with_a_resume_from_the_middle(tiny_model_dir, tmp_path):
    from trainer.rl.loop import train

    agent = tmp_path / "agent.py"  # one call, the standard library only: a step's episodes start in milliseconds
    agent.write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    lines = (TERSE / "tasks.jsonl").read_text().splitlines()[:3]
    tasks.write_text("\n".join(lines) + "\n")
    up = ScriptedUpstream()
    try:
        def run(total_steps: int) -> None:
            train(load_config(TERSE.parent / "train" / "terse.yaml", [
                f"model.path={tiny_model_dir}", f"rollout.engine.url={up.url}", f"data.train={tasks}",
                f"rollout.agent={agent}",
                f"logging.run_dir={tmp_path}", f"trainer.total_steps={total_steps}", "rollout.batch_size=2",
                "rollout.num_repeat=2", "rollout.concurrency=4", "trainer.ppo_epochs=1", "trainer.mini_batch_size=1",
                "trainer.save_freq=6", "trainer.keep_checkpoints=1", "logging.curve_png=false",
                "logging.console=false"]))

        run(12)
        run(24)  # trainer.resume auto: from step 12's checkpoint
    finally:
        up.close()
    db = tmp_path / "terse" / "harness.duckdb"
    rows = db_rows(db, "SELECT run_id, task_id, episode_id FROM episode_outcomes WHERE run_id LIKE '%-train%' "
                   "ORDER BY run_id, task_id, repeat_index")
    steps: dict[int, list[str]] = {}
    for run_id, task_id, _ in rows:
        steps.setdefault(int(run_id.rsplit("train", 1)[1]), []).append(task_id)
    assert sorted(steps) == list(range(1, 25))
    ids = [episode_id for *_, episode_id in rows]
    assert len(ids) == len(set(ids)) == 24 * 2 * 2
    for step in range(1, 25):
        distinct = set(steps[step])
        assert len(distinct) == 2 and sorted(steps[step]) == sorted(
            list(distinct) * 2), (step, steps[step])
    names = sorted(json.loads(line)["id"] for line in lines)
    for first in range(1, 25, 3):  # three steps take six tasks: two whole passes, each task twice
        taken = sorted(t for step in range(first, first + 3) for t in set(steps[step]))
        assert taken == sorted(names * 2), (first, taken)
    checkpoints = sorted(p.name for p in (tmp_path / "terse" / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_24"]
