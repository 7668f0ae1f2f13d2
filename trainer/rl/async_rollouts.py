"""Asynchronous rollouts (`rollout.async.max_staleness: K`): a thread collects the episodes of the next steps while
the loop trains, and the loop takes each step's rollout in order.

    rollout thread:  collect(1)  collect(2)  collect(3) ...   collect(s) starts once the engine serves s-1-K
    loop:                        train(1) push(v1)  train(2) push(v2) ...

So step s trains weights version s-1 on episodes sampled with versions s-1-K and later: each call records the
version it was sampled with (`calls.weight_version`; a call that was generating while new weights arrived also
records `extra.weights_changed_to`), and the off-policy correction (`trainer.correction`) uses the engine's logprobs of
the tokens as they were sampled. `keep_fresh` drops what lags further than K versions (the bound the thread keeps
holds it off, but a group that ran long over a resumed run's first pushes could lag), whole GRPO groups at a time,
and counts it. Validation runs alone (`alone`): its episodes use other sampling settings on the same proxy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from harness.core.records import Task
from trainer.rl.experience import Experience
from trainer.rl.rollout import StepRollout, mean

log = logging.getLogger("harness.train")


class RolloutsAhead:
    """Collects each planned step's rollout on a thread of its own, at most `max_staleness` versions ahead of the
    weights the engine serves; `take(step)` hands them over in order."""

    def __init__(self, collect: Callable[[int, list[Task]], StepRollout], plan: Sequence[tuple[int, list[Task]]],
                 max_staleness: int, served_version: int, stop: Callable[[], None] | None = None):
        self._collect, self._plan, self.max_staleness = collect, list(plan), max_staleness
        self._stop_collect = stop  # ends a collect under way (Rollouts.stop)
        self._served = served_version  # the weights version the engine serves now
        self._ready: dict[int, StepRollout | BaseException] = {}
        self._cond = threading.Condition()
        self._alone = threading.Lock()  # held by each collect; validation holds it to run alone
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="harness-rollouts-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step, tasks in self._plan:
            with self._cond:
                self._cond.wait_for(lambda s=step: self._closing or self._served >= s - 1 - self.max_staleness)
                if self._closing:
                    return
            try:
                with self._alone:
                    result: StepRollout | BaseException = self._collect(step, tasks)
            except BaseException as exc:  # handed to the loop, which raises it at take()
                result = exc
            with self._cond:
                self._ready[step] = result
                self._cond.notify_all()
            if isinstance(result, BaseException):
                return

    def take(self, step: int) -> StepRollout:
        """Step `step`'s rollout, waiting for it if it is still running."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or not self._thread.is_alive())
            if step not in self._ready:
                raise RuntimeError(f"the rollout thread ended before step {step}'s episodes were collected")
            result = self._ready.pop(step)
        if isinstance(result, BaseException):
            raise result
        return result

    def served(self, version: int) -> None:
        """The engine serves weights `version` now: steps up to version + 1 + max_staleness may start."""
        with self._cond:
            self._served = version
            self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """No training episodes run meanwhile (validation); the one under way finishes first."""
        with self._alone:
            yield

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop collecting: a collect under way is ended (its episodes interrupted) and nothing new starts."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._stop_collect is not None:
            self._stop_collect()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the rollout thread did not end within %.0f s", timeout_s)


def plan_steps(first: int, last: int, next_batch: Callable[[int], tuple[list[Task], int]], data_pos: int):
    """The tasks of each step first..last and the data position after it: [(step, tasks, data_pos)]."""
    plan = []
    for step in range(first, last + 1):
        tasks, data_pos = next_batch(data_pos)
        plan.append((step, tasks, data_pos))
    return plan


def keep_fresh(exp: Experience, version: int, max_staleness: int) -> tuple[Experience, dict[str, float]]:
    """The experience without the GRPO groups whose oldest sample was sampled more than `max_staleness` versions
    before `version` (the weights it trains); how stale what is kept is, and what was dropped."""
    assert exp.versions is not None, "keep_fresh needs each sample's weight version (experience_of)"
    oldest: dict[str, int] = {}
    for i, v in enumerate(exp.versions):
        group = exp.groups[exp.unit(i)]
        oldest[group] = min(v, oldest.get(group, v))
    stale = {g for g, v in oldest.items() if version - v > max_staleness}
    keep = [i for i in range(len(exp.samples)) if exp.groups[exp.unit(i)] not in stale]
    lags = [version - exp.versions[i] for i in keep]
    metrics = {"async/staleness_mean": mean(lags), "async/staleness_max": max(lags, default=None),
               "async/groups_dropped_stale": len(stale), "async/samples_dropped_stale": len(exp.samples) - len(keep)}
    if not stale:
        return exp, metrics
    log.warning("%d groups sampled more than %d versions before version %d dropped", len(stale), max_staleness,
                version)
    fresh = replace(
        exp, samples=[exp.samples[i] for i in keep], versions=[exp.versions[i] for i in keep],
        units=[exp.unit(i) for i in keep] if exp.units is not None else None,
        call_spans=[exp.call_spans[i] for i in keep] if exp.call_spans is not None else None,
        policies=[exp.policies[i] for i in keep] if exp.policies is not None else None,
        rewards={u: r for u, r in exp.rewards.items() if exp.groups[u] not in stale},
        groups={u: g for u, g in exp.groups.items() if g not in stale})
    return fresh, metrics
