"""Experience for one training step: the unmodified agent's episodes through the recording proxy, judged, merged.

    tasks -> Runner (agent subprocesses, each with its episode URL) -> proxy -> engine   (calls recorded in DuckDB)
          -> judge (rewards) -> merge_episode (samples, stored with their reward) -> StepRollout

One proxy serves the whole training run, on its own loop in a thread; each step's episodes run on that loop
(`ProxyServer.call`), so the runner shares the proxy's store and episode table as in `harness run`. Every step is
a run of its own in `episode_outcomes` (`<run>-train00003`), so the usual SQL works per step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.core.flags import PARSE
from harness.core.merge import Merged, merge_episode, summarise_merges
from harness.core.records import FINISHED, INFRA_ERROR, INTERRUPTED, Call, EpisodeOutcome, Judgement, Sample, Task
from harness.running.hub import model_name
from harness.running.proxied import agent_env, agents_config, proxy_config
from harness.running.report import pass_at_k
from harness.running.runner import RunConfig, Runner, start_warm
from harness.running.vllm_server import Engine, attach, start_vllm
from harness.running.warm import WarmStarter
from harness.store.database import Store
from proxy.config import SamplingOverrides
from proxy.guard import DEGENERATE, GuardConfig
from proxy.roles import RoleRule
from proxy.server import ProxyServer
from trainer.config import TrainConfig, role_rules, trains
from trainer.config.memory import placement_of
from trainer.config.roles import adapters_of
from trainer.model.lora import ENGINE_ENV, adapters_in_use, engine_args, spec_of
from trainer.model.tied import engine_view, ties_embeddings

log = logging.getLogger("harness.train")
GUARD_JUDGE = "guard"  # the judge name of the guard's penalty in `judgements` (rollout.guard.penalty)


@dataclass
class EpisodeResult:
    """One episode of a step: how it ended, its reward, and its merged samples."""

    episode_id: str
    task_id: str
    status: str  # EpisodeOutcome.status
    reward: float | None  # the judge's reward; None when unjudged or the judge failed
    samples: list[Sample]
    merged: Merged
    truncated: int  # replies cut off by max_tokens (finish_reason "length")
    call_spans: list[list[tuple[int, int, float]]]  # per sample: (start, end, reward) of each call the judge scored
    sample_roles: list[str | None] = field(default_factory=list)  # per sample: its calls' role name (None: unnamed)
    role_rewards: dict[str, float] = field(default_factory=dict)  # the judge's per-role rewards, if it gave any
    sample_versions: list[int] = field(default_factory=list)  # per sample: the oldest weight version of its calls
    degenerate: int = 0  # completions the degenerate-output guard flagged (proxy/guard.py)
    penalized: bool = False  # the reward is rollout.guard.penalty, not the judge's
    ended: str | None = None  # "max_turns" or "guard" when the proxy ended the episode early
    over_max_samples: int = 0  # samples past rollout.max_samples_per_episode: stored, not trained
    unparsed: dict[str, int] = field(default_factory=dict)  # replies whose tool call or reasoning did not parse


@dataclass
class StepRollout:
    episodes: list[EpisodeResult]
    timings: dict[str, float]  # rollout_s (agents, judges included), judge_s (summed waits), merge_s
    merge: dict  # merge summary: ratio, drift rate, reasons (harness.core.merge.summarise_merges)
    baselines: dict[str, float] | None = None  # remax: task -> its greedy episode's reward (greedy_baselines)


class Rollouts:
    """The engine behind a recording proxy, for the whole training run."""

    def __init__(self, engine: Engine, run_dir: Path, run: RunConfig, *, sampling: SamplingOverrides,
                 token_exact: bool = True, reasoning_history: str = "as_rendered", roles: tuple[RoleRule, ...] = (),
                 interceptor=None, more_engines: tuple[Engine, ...] = (), guard: GuardConfig = GuardConfig(),
                 max_turns: int | None = None, max_samples: int | None = None, penalty: float | None = None,
                 learns: Callable[[str | None], bool] = lambda role: True):
        self.engine = engine
        self.max_samples = max_samples  # samples an episode trains; the rest are marked max_samples
        self.learns = learns  # whether samples of a role learn (a frozen role's neither train nor count)
        self.penalty = penalty  # the reward of an episode with a degenerate completion (None: the judge's)
        self.more_engines = more_engines  # more engines of the same policy (proxy/upstreams.py)
        self.run_dir = run_dir
        self.sampling = sampling
        config = proxy_config(engine, run_dir, sampling=sampling, token_exact=token_exact, roles=roles,
                              reasoning_history=reasoning_history,
                              more_upstreams=tuple(e.base_url for e in more_engines), guard=guard,
                              max_turns=max_turns)
        self.run = agents_config(run, config)
        if not engine.returns_token_ids:
            raise ValueError(f"the engine at {engine.base_url} returns no token ids: training needs vLLM's ids")
        self.server = ProxyServer(config)
        self._runner: Runner | None = None  # the collect under way
        self._warm: WarmStarter | None = None  # one warm starter for every collect (running/warm.py), once started
        self._warm_tried = False
        self._warm_lock = threading.Lock()  # collects may start from several threads (adapters/verl_loop.py)
        self._stopped = False  # stop() was called: every collect from then on ends at once
        self.url = self.server.start_in_thread(spawns=True)  # the runner starts the agents on its loop
        self.admin_token = config.admin_token
        self.interceptor = interceptor  # transparent mode's hop (proxy/transparent.py), or None
        if interceptor is not None:
            try:
                interceptor.start(self.url)
            except BaseException:
                self.server.stop_thread()
                raise

    @property
    def run_id(self) -> str:
        return self.server.run_id

    @property
    def store(self) -> Store:
        return self.server.store

    def collect(self, step: int, tasks: list[Task], *, tag: str = "train", repeat: int | None = None,
                sampling: SamplingOverrides | None = None, judge_pool=None) -> StepRollout:
        """Run every task `repeat` times (the GRPO group), judge, merge; blocks until all episodes ended.
        judge_pool: a JudgePool the caller keeps open across collects (else the Runner makes one per collect).
        The guard's penalty is a training reward: validation episodes (tag "val") keep their judge's."""
        self.server.use_sampling(sampling or self.sampling)
        with self._warm_lock:
            if not self._warm_tried:
                self._warm_tried = True
                self._warm = self.server.call(start_warm(self.run, self.run_dir))
        runner = Runner(replace(self.run, repeat=repeat or self.run.repeat), run_id=f"{self.run_id}-{tag}{step:05d}",
                        proxy=self.server, run_dir=self.run_dir, episode_env=agent_env(self.interceptor),
                        judge_pool=judge_pool, warm=self._warm)
        started = time.perf_counter()
        self._runner = runner
        if self._stopped:  # stopped while this collect was starting: it starts no episode
            self.server.call(_stop(runner))
        try:
            self.server.call(runner.run(tasks))
        except KeyboardInterrupt:
            self.server.call(_stop(runner))
            raise
        finally:
            self.server.use_sampling(self.sampling)
            self._runner = None
        rollout_s = time.perf_counter() - started
        started = time.perf_counter()
        self.server.flush()
        position = {t.task_id: k for k, t in enumerate(tasks)}
        outcomes = sorted(runner.outcomes, key=lambda o: (position[o.task_id], o.repeat_index))  # not finish order
        episodes = self._merge(outcomes, {j.episode_id: j for j in runner.judgements}, penalize=tag != "val")
        timings = {"rollout_s": rollout_s, "judge_s": runner.judge_s, "merge_s": time.perf_counter() - started}
        return StepRollout(episodes, timings, summarise_merges([e.merged for e in episodes]))

    def _merge(self, outcomes: list[EpisodeOutcome], judgements: dict[str, Judgement],
               penalize: bool = True) -> list[EpisodeResult]:
        ids = [o.episode_id for o in outcomes]
        calls = self.store.load_episodes_calls(ids)
        results, items, penalties = [], [], []
        for o in outcomes:
            episode_calls = calls.get(o.episode_id, [])
            by_id = {c.call_id: c for c in episode_calls}
            merged = merge_episode(episode_calls)
            roles = [by_id[s.call_ids[0]].extra.get("role") if s.call_ids else None for s in merged.samples]
            merged, over = _capped(merged, self.max_samples, [self.learns(role) for role in roles])
            judgement = judgements.get(o.episode_id)
            reward = judgement.reward if judgement is not None else None
            flags = [(c.call_id, f) for c in episode_calls for f in c.extra.get("flags", ())]
            found = sorted({f["reason"] for _, f in flags if f["kind"] == DEGENERATE})
            degenerate = len({(call_id, f["choice"]) for call_id, f in flags if f["kind"] == DEGENERATE})
            # the guard's reward replaces the judge's (per call and per role too), unless the episode's end was not
            # the agent's doing (the engine unreachable, the run stopped)
            penalized = (penalize and degenerate > 0 and self.penalty is not None
                         and o.status not in (INFRA_ERROR, INTERRUPTED))
            if penalized:
                penalties.append(Judgement(o.episode_id, GUARD_JUDGE, GUARD_JUDGE, self.penalty,
                                           {"degenerate": found, "judge_reward": reward}, None, time.time()))
                reward, judgement = self.penalty, None
            try:
                call_rewards = call_rewards_of(judgement, o.episode_id)
            except ValueError as exc:  # a judge's mistake costs its per-call rewards, never the step
                log.warning("%s: per-call rewards ignored", exc)
                call_rewards = {}
            try:
                role_rewards = role_rewards_of(judgement, o.episode_id)
            except ValueError as exc:
                log.warning("%s: per-role rewards ignored", exc)
                role_rewards = {}
            spans = [_call_spans(s, episode_calls, call_rewards) for s in merged.samples]
            truncated = sum(ch.finish_reason == "length" for c in episode_calls for ch in c.choices)
            versions = [min((by_id[c].weight_version for c in s.call_ids), default=0) for s in merged.samples]
            ended = next((f["reason"] for _, f in flags if f["reason"] in ("max_turns", "guard")), None)
            kept = [k for k, s in enumerate(merged.samples) if "max_samples" not in s.truncation]
            results.append(EpisodeResult(o.episode_id, o.task_id, o.status, reward, [merged.samples[k] for k in kept],
                                         merged, truncated, [spans[k] for k in kept], [roles[k] for k in kept],
                                         role_rewards, [versions[k] for k in kept], degenerate, penalized, ended,
                                         over, dict(Counter(f["reason"] for _, f in flags if f["kind"] == PARSE))))
            items.append((o.episode_id, merged, reward))
        self.store.add_merged_episodes(self.run_id, items)
        self.store.add_judgements(penalties)  # the rewards view, export and --from-run see what was trained
        return results

    def stop(self) -> None:
        """From another thread, for good (shutdown): the collect under way, and any that starts from now on, starts
        no new episode and interrupts its running ones."""
        self._stopped = True
        runner = self._runner
        if runner is not None:
            self.server.call(_stop(runner))

    def close(self) -> None:
        """Stop the hop, the warm starter and the proxy; a second call (an atexit hook after an explicit close) does
        nothing."""
        interceptor, warm, self.interceptor, self._warm = self.interceptor, self._warm, None, None
        if interceptor is not None:
            interceptor.close()
        if warm is not None:
            self.server.call(warm.close())
        self.server.stop_thread()


def _capped(merged: Merged, limit: int | None, learns: list[bool]) -> tuple[Merged, int]:
    """The merge with its learning samples past the first `limit` marked max_samples (stored, not trained), and how
    many those are. `learns[k]`: whether sample k's role learns; a frozen role's samples neither count nor are
    marked."""
    if limit is None:
        return merged, 0
    samples, seen, over = [], 0, 0
    for sample, learning in zip(merged.samples, learns, strict=True):
        seen += learning
        if learning and seen > limit:
            sample = replace(sample, truncation=sorted({*sample.truncation, "max_samples"}))
            over += 1
        samples.append(sample)
    return (replace(merged, samples=samples), over) if over else (merged, 0)


def start_rollouts(cfg: TrainConfig, out: Path) -> Rollouts:
    """The engines of a training run (attached or started) behind one recording proxy, as the config says."""
    engine, *more = start_engines(cfg, out)
    r = cfg.rollout
    try:
        return Rollouts(engine, out, run_config(cfg), sampling=SamplingOverrides(
            temperature=r.temperature, top_p=r.top_p, max_tokens_cap=r.max_tokens, seed=sampling_seed(cfg)),
            token_exact=r.token_exact, reasoning_history=r.reasoning_history, roles=role_rules(cfg),
            interceptor=interceptor_for(r, out), more_engines=tuple(more), guard=guard_of(dataclasses.asdict(r.guard)),
            max_turns=r.max_turns, max_samples=r.max_samples_per_episode, penalty=r.guard.penalty,
            learns=functools.partial(trains, cfg))
    except BaseException:
        for e in (engine, *more):
            e.stop()
        raise


def greedy_baselines(rollouts: Rollouts, step: int, tasks: list[Task], cfg: TrainConfig) -> dict[str, float]:
    """ReMax's baselines: each task's reward when the policy decodes greedily, one episode per task (recorded as
    run `<run>-greedy<step>`); a task whose greedy episode failed or was not judged has none."""
    r = cfg.rollout
    greedy = rollouts.collect(step, tasks, tag="greedy", repeat=1, sampling=SamplingOverrides(
        temperature=0.0, top_p=1.0, max_tokens_cap=r.max_tokens, seed=sampling_seed(cfg)))
    return {e.task_id: e.reward for e in greedy.episodes if e.status == FINISHED and e.reward is not None}


def validate(rollouts: Rollouts, step: int, tasks, cfg: TrainConfig) -> dict[str, float]:
    """pass@n and mean reward of the validation tasks at validation sampling."""
    v = cfg.rollout.validation
    rollout = rollouts.collect(step, tasks, tag="val", repeat=v.n,
                               sampling=SamplingOverrides(temperature=v.temperature, top_p=v.top_p,
                                                          max_tokens_cap=cfg.rollout.max_tokens,
                                                          seed=sampling_seed(cfg)))
    threshold = cfg.task_judge.success_threshold
    by_task: dict[str, list[bool]] = {}
    for e in rollout.episodes:
        by_task.setdefault(e.task_id, []).append(e.reward is not None and e.reward >= threshold)
    rewards = [e.reward for e in rollout.episodes if e.reward is not None]
    passes = [pass_at_k(len(hits), sum(hits), v.n) for hits in by_task.values()]
    return {"val/pass@n": mean(passes), "val/reward_mean": mean(rewards), "time/validation_s":
            rollout.timings["rollout_s"]}


def mean(values) -> float | None:
    """The mean of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def guard_of(settings: dict) -> GuardConfig:
    """The proxy's guard from rollout.guard's keys, as a mapping (the penalty is the trainer's business)."""
    return GuardConfig(**{k: v for k, v in settings.items() if k != "penalty"})


def run_config(cfg: TrainConfig) -> RunConfig:
    """How the agents of a training run are run (harness/running/runner.py), from the rollout section."""
    import shlex
    import sys

    r = cfg.rollout
    command = [sys.executable, str(r.agent)] if r.agent else shlex.split(r.command)
    # debug: one episode at a time, the agent on the terminal, the judge in this process, no timeouts (runner.py)
    return RunConfig(command=command, judge=cfg.task_judge.judge, repeat=r.num_repeat, concurrency=r.concurrency,
                     timeout_s=r.timeout_s, retries=r.retries, judge_timeout_s=cfg.task_judge.timeout_s,
                     judge_workers=cfg.task_judge.workers, cwd=r.cwd, env=dict(r.env), debug=cfg.debug.enabled,
                     memory_mb=r.memory_mb or None, max_procs=r.max_procs or None, warm_start=r.warm_start,
                     sandbox=None if r.sandbox in ("auto", "none") else r.sandbox,
                     sandbox_binds=tuple(r.sandbox_binds), blocked_commands=tuple(r.blocked_commands))


def start_engines(cfg: TrainConfig, out: Path) -> list[Engine]:
    """The engines serving the policy: attached (engine.url, engine.more_urls; with LoRA, started with
    trainer/model/lora.py's engine_args and ENGINE_ENV) or started (rollout.engines), each on the GPU and with the
    memory share the memory plan gives it (config.memory.placement_of; on CPU none), with sleep mode when
    rollout.engine.sleep is on."""
    e, parsers = cfg.rollout.engine, {"tool_parser": cfg.rollout.tool_parser,
                                      "reasoning_parser": cfg.rollout.reasoning_parser}
    if e.url:
        return [attach(url, **parsers) for url in (e.url, *e.more_urls)]
    served = engine_model_dir(cfg, out)
    if served != Path(cfg.model.path):  # tied embeddings: the engines serve the untied view
        engine_view(cfg.model.path, served)
    lora = spec_of(cfg.trainer.lora)
    loaded = adapters_in_use(cfg.rollout.async_.max_staleness) * max(len(adapters_of(cfg)), 1)  # per policy
    extra, env = [*(engine_args(lora, loaded) if lora else []), *e.extra_args], ENGINE_ENV if lora else None
    placement = placement_of(cfg)  # checked at load
    started = []
    try:
        for k in range(cfg.rollout.engines):
            started.append(start_vllm(served, out / "logs" / (f"engine{k}" if k else ""),
                                      served_model_name=model_name(cfg.model.path),
                                      max_model_len=e.max_model_len, extra_args=extra, env=env,
                                      share=(k, cfg.rollout.engines) if cfg.rollout.engines > 1 else None,
                                      gpu=placement.engine_ids[k] if placement and placement.engine_ids else None,
                                      gpu_memory_utilization=placement.share if placement else None,
                                      sleep_mode=bool(e.sleep), **parsers))
    except BaseException:
        for engine in started:
            engine.stop()
        raise
    return started


def engine_model_dir(cfg: TrainConfig, out: Path) -> Path:
    """The model directory the engines serve and every push rewrites: the model itself, or for a model that ties
    its embeddings, trained with full weights, its untied view in the run directory (trainer/model/tied.py)."""
    if spec_of(cfg.trainer.lora) is None and ties_embeddings(cfg.model.path):
        return out / "engine-model"
    return Path(cfg.model.path)


def sampling_seed(cfg: TrainConfig) -> int | None:
    if cfg.rollout.seed is not None:
        return cfg.rollout.seed
    return cfg.debug.seed if cfg.debug.enabled else None


async def _stop(runner: Runner) -> None:
    runner.stop()


def call_rewards_of(judgement: Judgement | None, episode_id: str) -> dict[int, float]:
    """Per-call rewards a judge returned in its details as "call_rewards": a list by call_index (None for calls
    it did not score) or a mapping {call_index: reward}. Outcome rewards alone are the default."""
    raw = (judgement.details or {}).get("call_rewards") if judgement is not None and judgement.reward is not None \
        else None
    if raw is None:
        return {}
    items = enumerate(raw) if isinstance(raw, list) else raw.items() if isinstance(raw, dict) else None
    if items is None:
        raise ValueError(f"episode {episode_id!r}: the judge's call_rewards must be a list by call index or a "
                         f"mapping {{call_index: reward}}, got {type(raw).__name__}")
    out = {}
    for index, value in items:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not str(index).lstrip("-").isdigit():
            raise ValueError(f"episode {episode_id!r}: call_rewards[{index!r}] = {value!r}; give a number per call "
                             "index")
        out[int(index)] = float(value)
    return out


def interceptor_for(rollout, out: Path):
    """Transparent mode's hop for the rollout section (proxy/transparent.py, loaded only when chosen), or None."""
    if not rollout.transparent:
        return None
    from proxy.transparent import Interceptor, TransparentOptions

    options = TransparentOptions(llm_hosts=tuple(rollout.llm_hosts), refuse_other=rollout.refuse_other_hosts)
    return Interceptor(options, log_path=out / "transparent.log")


def role_rewards_of(judgement: Judgement | None, episode_id: str) -> dict[str, float]:
    """Per-role rewards a judge returned in its details as "role_rewards": {role name: reward}. A role it does not
    name gets the episode's reward."""
    raw = (judgement.details or {}).get("role_rewards") if judgement is not None and judgement.reward is not None \
        else None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"episode {episode_id!r}: the judge's role_rewards must be a mapping {{role name: reward}}, "
                         f"got {type(raw).__name__}")
    out = {}
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"episode {episode_id!r}: role_rewards[{name!r}] = {value!r}; give a number per role")
        out[str(name)] = float(value)
    return out


def _call_spans(sample: Sample, calls: list[Call], rewards: dict[int, float]) -> list[tuple[int, int, float]]:
    """Where each scored call's completion sits in the sample: (start, end, reward)."""
    if not rewards:
        return []
    by_id = {c.call_id: c for c in calls}
    spans = []
    for call_id, choice_index in zip(sample.call_ids, sample.choice_indices, strict=True):
        call = by_id[call_id]
        reward = rewards.get(call.call_index)
        choice = next((ch for ch in call.choices if ch.index == choice_index), None)
        if reward is None or choice is None or not choice.completion_ids:
            continue
        start = len(call.prompt_ids)
        spans.append((start, start + len(choice.completion_ids), reward))
    return spans
