"""The order of a run's tasks: every batch crosses pass boundaries without holding a task twice, every pass covers
every task once, and a resumed run takes the same batches; a batch larger than the dataset gives its repeated
tasks distinct episode ids in one group."""

from __future__ import annotations

import pytest

from harness.core.records import Task
from harness.running.runner import plan_episodes
from trainer.maths.schedule import next_tasks


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 10, 16])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [True, False])
def test_no_batch_holds_a_task_twice_and_every_pass_covers_every_task(n, size, shuffle):
    if size > n:
        pytest.skip("a batch larger than the dataset must repeat tasks (test_a_batch_larger_than_the_dataset...)")
    tasks, pos, taken = list(range(n)), 0, []
    for _ in range(24 * max(1, n // size)):
        batch, pos = next_tasks(tasks, pos, size, shuffle, seed=3)
        assert len(set(batch)) == len(batch), (n, size, batch)
        taken += batch
    for start in range(0, len(taken) - n + 1, n):
        assert sorted(taken[start:start + n]) == tasks


def test_three_tasks_in_batches_of_two_the_case_that_crashed_runs():
    """The reported case: 3 tasks, batch 2, shuffled; one batch in three spans two passes."""
    pos, spanning = 0, 0
    for step in range(24):
        batch, after = next_tasks(["t0", "t1", "t2"], pos, 2, True, seed=0)
        spanning += pos // 3 != (after - 1) // 3
        assert len(set(batch)) == 2, (step, batch)
        pos = after
    assert spanning == 8


def test_a_resumed_run_takes_the_same_batches_from_its_saved_position():
    tasks = [f"t{k}" for k in range(5)]
    pos, straight = 0, []
    for _ in range(20):
        batch, pos = next_tasks(tasks, pos, 3, True, seed=11)
        straight.append((batch, pos))
    _, saved = straight[9]
    from trainer.maths import schedule

    schedule._orders.clear()  # a new process: nothing computed before the resume
    pos, resumed = saved, []
    for _ in range(10):
        batch, pos = next_tasks(tasks, pos, 3, True, seed=11)
        resumed.append((batch, pos))
    assert resumed == straight[10:]


def test_the_order_depends_on_the_seed_and_shuffle():
    tasks = list(range(20))
    assert next_tasks(tasks, 0, 20, False, 0)[0] == tasks
    assert next_tasks(tasks, 0, 20, True, 1)[0] != next_tasks(tasks, 0, 20, True, 2)[0]


def test_a_batch_larger_than_the_dataset_gives_distinct_episode_ids_in_one_group():
    tasks = [Task("a", {"q": 1}), Task("b", {"q": 2})]
    batch, _ = next_tasks(tasks, 0, 5, True, seed=0)
    slots = plan_episodes("run-train00001", batch, repeat=2)
    ids = [s.episode_id for s in slots]
    assert len(ids) == len(set(ids)) == 10
    for task in tasks:
        given = sum(t.task_id == task.task_id for t in batch)
        indices = sorted(s.repeat_index for s in slots if s.task.task_id == task.task_id)
        assert indices == list(range(2 * given))  # one group: its repeat indices go on
