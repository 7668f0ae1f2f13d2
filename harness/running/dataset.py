"""`harness run` and `harness judge`: a dataset run end to end, and re-judging a stored run offline.

    tasks -> proxy (in this process, its own DuckDB) -> Runner (agent subprocesses) -> JudgePool -> merge -> report

A run and a re-judge both end by merging every episode of the run into samples (harness.core.merge), each sample with
its episode's latest judgement as reward (harness/store/samples.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections import Counter
from datetime import UTC
from pathlib import Path

from harness.core.records import EpisodeOutcome, Judgement, Task
from harness.running import harbor
from harness.running.judge_pool import JudgePool
from harness.running.judges import load_judge
from harness.running.proxied import agent_env, agents_config, proxy_config
from harness.running.report import build_report, print_report
from harness.running.runner import RunConfig, Runner
from harness.running.vllm_server import Engine
from harness.store.database import Store
from harness.store.samples import merge_recorded
from proxy.config import SamplingOverrides
from proxy.server import ProxyServer

log = logging.getLogger(__name__)


async def run_dataset(tasks: list[Task], config: RunConfig, engine: Engine, run_dir: Path, *,
                      success_threshold: float = 1.0, sampling: SamplingOverrides | None = None,
                      token_exact: bool = True, reasoning_history: str = "as_rendered",
                      progress: bool = True, interceptor=None, roles: tuple = (),
                      more_upstreams: tuple[str, ...] = (), record_only: bool = False,
                      upstream_key_env: str | None = None, proxy_settings: dict | None = None) -> tuple[str, dict]:
    """Run every task `config.repeat` times through a fresh proxy; returns (run_id, report). With an
    `interceptor` (proxy.transparent.Interceptor, transparent mode), it is started in front of the proxy and
    each agent gets its environment too. `record_only`: the engine is any API, every call goes on as the agent
    sent it, with the key in `upstream_key_env` (agents carry episode tokens; that variable is hidden from them).
    `proxy_settings`: ProxyConfig's max_turns, guard and hosted_tools (harness/cli/options.py's proxy_settings)."""
    # A typo in the judge fails here, before any agent runs; judgements carry the judge's normalised name.
    judge_name = load_judge(config.judge).name if config.judge else (
        harbor.JUDGE if any(harbor.is_harbor(t) for t in tasks) else "none")  # Harbor tasks: their tests/test.sh
    run_dir.mkdir(parents=True, exist_ok=True)
    proxy = proxy_config(engine, run_dir, sampling=sampling or SamplingOverrides(), token_exact=token_exact,
                         reasoning_history=reasoning_history, roles=roles, more_upstreams=more_upstreams,
                         record_only=record_only, upstream_key_env=upstream_key_env, **(proxy_settings or {}))
    server = ProxyServer(proxy)
    url = await server.start()
    try:
        if interceptor is not None:
            await asyncio.to_thread(interceptor.start, url)
    except BaseException:
        await server.stop()
        raise
    bar = _Progress(len(tasks) * config.repeat, enabled=progress, concurrency=config.concurrency)
    runner = Runner(agents_config(config, proxy), run_id=server.run_id, proxy=server, run_dir=run_dir,
                    on_episode=bar.update, episode_env=agent_env(interceptor))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, runner.stop)
    try:
        with bar:
            await runner.run(tasks)
        await asyncio.to_thread(server.flush)
        merge = await asyncio.to_thread(_merge_after_run, server.store, server.run_id)
        report = _report(server.store, server.run_id, runner.outcomes, runner.judgements, judge_name,
                         success_threshold)
        report["interrupted"] = runner.stopped
        report["merge"] = merge
        if sandboxed := [o for o in runner.outcomes if o.sandbox is not None]:
            report["sandbox_flags"] = dict(Counter(f["reason"] for o in sandboxed for f in o.sandbox["flags"]))
        await asyncio.to_thread(server.store.add_report, server.run_id, judge_name, report)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if interceptor is not None:
            interceptor.close()
        await server.stop()
    (run_dir / f"report-{server.run_id}.json").write_text(json.dumps(report, indent=2))
    return server.run_id, report


def _report(store: Store, run_id: str, outcomes, judgements, judge: str, success_threshold: float) -> dict:
    tokens = store.query("SELECT episode_id, coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0) "
                         "FROM calls WHERE run_id = ? GROUP BY 1", [run_id]).rows
    latencies = store.query("SELECT latency_ms FROM calls WHERE run_id = ? AND status = 'ok'", [run_id]).rows
    flagged = store.query("SELECT kind || ':' || reason, count(DISTINCT episode_id) FROM flags WHERE run_id = ? "
                          "GROUP BY 1", [run_id]).rows
    return build_report(outcomes, judgements, judge=judge, success_threshold=success_threshold,
                        episode_tokens={e: (int(p), int(c)) for e, p, c in tokens},
                        call_latencies_ms=[r[0] for r in latencies], flagged=dict(flagged))


async def rejudge(db_path: Path, run_id: str | None, judge: str, *, success_threshold: float = 1.0,
                  workers: int = 2, timeout_s: float = 60.0) -> tuple[str, dict]:
    """Score a stored run's episodes with `judge`, without running any agent; returns (run_id, report)."""
    judge_name = load_judge(judge).name
    store = Store.open(db_path)
    try:
        if run_id is None:
            rows = store.query("SELECT run_id FROM episode_outcomes GROUP BY 1 ORDER BY min(started_at) DESC "
                               "LIMIT 1").rows
            if not rows:
                raise ValueError(f"{db_path} holds no dataset run to judge (no episode_outcomes rows)")
            run_id = rows[0][0]
        outcomes = _outcomes(store, run_id)
        if not outcomes:
            raise ValueError(f"run {run_id!r} has no episodes in {db_path}: see `harness sql \"SELECT run_id, "
                             "count(*) FROM episode_outcomes GROUP BY 1\"`")
        tasks = dict(store.query("SELECT episode_id, meta->'task' FROM episodes WHERE episode_id IN "
                                 "(SELECT episode_id FROM episode_outcomes WHERE run_id = ?)", [run_id]).rows)
        judgements: list[Judgement] = []
        async with JudgePool(judge, workers=workers, timeout_s=timeout_s) as pool:
            async def one(o: EpisodeOutcome) -> None:
                task = json.loads(tasks[o.episode_id]) if tasks.get(o.episode_id) else {}
                calls = await asyncio.to_thread(store.episode_calls, o.episode_id)
                judgements.append(await pool.judge(o.episode_id, task, o.answer, calls))

            await asyncio.gather(*(one(o) for o in outcomes if o.status not in ("infra_error", "interrupted")))
        store.add_judgements(judgements)
        merge = _merge_after_run(store, run_id)  # the samples' reward slots take the new judgements
        report = _report(store, run_id, outcomes, judgements, judge_name, success_threshold)
        report["merge"] = merge
        store.add_report(run_id, judge_name, report)
        return run_id, report
    finally:
        store.close()


def _outcomes(store: Store, run_id: str) -> list[EpisodeOutcome]:
    # The last attempt of each episode slot stands for it (earlier attempts failed on infrastructure).
    rows = store.query("SELECT * FROM episode_outcomes WHERE run_id = ? QUALIFY row_number() OVER "
                       "(PARTITION BY task_id, repeat_index ORDER BY attempt DESC) = 1 "
                       "ORDER BY task_id, repeat_index", [run_id]).rows
    return [EpisodeOutcome(*row[:9], row[9].replace(tzinfo=UTC).timestamp(), *row[10:12],
                           None if row[12] is None else json.loads(row[12])) for row in rows]


def _merge_after_run(store: Store, run_id: str) -> dict:
    """A run's merge must not cost it its report: a failure is logged and noted; `harness merge` can redo it."""
    try:
        return merge_recorded(store, run_id)
    except Exception as exc:  # noqa: BLE001 - logged with its traceback, reported, and the run goes on
        log.exception("merging run %s into samples failed; `harness merge --run %s` rebuilds them", run_id, run_id)
        return {"error": f"{type(exc).__name__}: {exc}"}


class _Progress:
    """The run's progress with the live mean reward and failure count: a bar on a terminal; elsewhere (nohup, CI, a
    pipe) plain lines on stderr, one per tenth of the episodes or every _EVERY_S, and a line every _EVERY_S while
    none finishes; silent when disabled (--debug, whose agents own the terminal)."""

    def __init__(self, total: int, enabled: bool, concurrency: int = 1):
        self.total, self.concurrency = total, concurrency
        self.bar = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.bar
        self.rewards: list[float] = []
        self.done = self.failures = 0
        self._progress = None
        self._started = self._said = time.monotonic()
        self._beat: asyncio.Task | None = None

    def __enter__(self):
        if self.bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("episodes"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task("run", total=self.total, stats="")
        elif self.plain:
            self._started = self._said = time.monotonic()
            self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        if self._beat is not None:
            self._beat.cancel()

    def update(self, outcome: EpisodeOutcome, judgement: Judgement | None) -> None:
        self.done += 1
        if judgement is not None and judgement.reward is not None:
            self.rewards.append(judgement.reward)
        if outcome.status != "finished" or (judgement is not None and judgement.error):
            self.failures += 1
        if self._progress is not None:
            self._progress.update(self._task, advance=1, stats=f"reward {self._mean()}  failures {self.failures}")
        elif self.plain and (self.done == self.total or self.done % max(1, self.total // 10) == 0
                             or time.monotonic() - self._said >= _EVERY_S):
            self._say()

    def line(self) -> str:
        running = min(self.concurrency, self.total - self.done)
        return (f"episodes {self.done}/{self.total} done, {running} running, reward mean {self._mean()}, "
                f"{self.failures} failed, {time.monotonic() - self._started:.0f} s")

    def _mean(self) -> str:
        return f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"

    def _say(self) -> None:
        self._said = time.monotonic()
        print(self.line(), file=sys.stderr, flush=True)

    async def _heartbeat(self) -> None:
        """A line every _EVERY_S while no episode finishes: agents can run for minutes."""
        while True:
            await asyncio.sleep(max(0.0, self._said + _EVERY_S - time.monotonic()))
            if time.monotonic() - self._said >= _EVERY_S:
                self._say()


_EVERY_S = 10.0


__all__ = ["print_report", "rejudge", "run_dataset"]
