"""`backbone: verl`: one harness episode as a verl agent loop.

verl's AgentLoopWorker (a Ray actor) instantiates the loop registered under the name `harness` (in the YAML file
that `actor_rollout_ref.rollout.agent.agent_loop_config_path` names; trainer/rl/verl_backbone.py writes it) for every
sample of a batch, and awaits `run()`. Here `run()`:

1. reads our task from the sample (`extra_info.task_json`, as trainer/rl/verl_backbone.py writes the dataset);
2. runs the unmodified agent on it through the recording proxy (trainer/rl/rollout.py's Rollouts: one per worker
   process, its DuckDB file in <run_dir>/verl/worker-<pid>/), whose engine is a TokenEngine over verl's
   `server_manager.generate`: token in, token out, on verl's own inference servers;
3. judges it with our judge (one judge pool per worker process, shared by all its episodes), merges its calls into
   samples (harness/core/merge.py) and returns them in verl's type: prompt ids, response ids, response mask (1 where the
   engine sampled), the engine's logprobs, the reward.

    verl AgentLoopWorker -> HarnessAgentLoop.run -> agent subprocess -> proxy (DuckDB) -> TokenEngine
                                                                                        -> server_manager.generate

This module imports verl: it is loaded only inside verl's workers and by tests that have verl.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import os
import shlex
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from adapters.token_server import Generated, TokenEngine
from harness.core.records import FINISHED, Task
from harness.running.judge_pool import JudgePool
from harness.running.limits import AGENT_MAX_PROCS, AGENT_MEMORY_MB
from harness.running.runner import RunConfig
from harness.running.vllm_server import Engine
from proxy.config import SamplingOverrides
from proxy.roles import parse_rules
from trainer.config.roles import learns
from trainer.rl.rollout import EpisodeResult, Rollouts, guard_of, interceptor_for

AGENT_NAME = "harness"  # the name the loop is registered under; the dataset's agent_name column says it


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs of the harness config; written into the agent-loop YAML entry as `harness:`."""

    run_dir: str  # the run directory; each worker records into <run_dir>/verl/worker-<pid>/harness.duckdb
    command: list[str]  # the agent command
    judge: str | None  # judge spec; None: reward 0 (verl's reward manager may still score the samples)
    served_model: str  # the model name the proxy serves the policy under
    max_model_len: int  # the rollout servers' context length
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0
    retries: int = 2
    judge_timeout_s: float = 60.0
    judge_workers: int = 2
    concurrency: int = 64  # episodes a worker runs at once
    token_exact: bool = True
    tool_parser: str = "hermes"
    reasoning_parser: str | None = None
    reasoning_history: str = "as_rendered"
    max_tokens: int | None = None  # cap on the agent's max_tokens per call
    memory_mb: int = AGENT_MEMORY_MB  # writable-memory cap (RLIMIT_DATA) of each agent (running/limits.py); 0: none
    max_procs: int = AGENT_MAX_PROCS  # processes and threads of each agent with its children (limits.py); 0: none
    max_turns: int | None = None  # LLM calls an episode may make (proxy/guard.py); None: no limit
    max_samples_per_episode: int | None = None  # samples an episode trains; the rest are marked, not trained
    guard: dict = field(default_factory=dict)  # rollout.guard's keys (proxy/guard.py's GuardConfig, and penalty)
    transparent: bool = False  # rollout.transparent: the agents' calls to LLM hosts reach the proxy through mitmproxy
    llm_hosts: list[str] = field(default_factory=list)  # with transparent: more LLM hosts to intercept
    refuse_other_hosts: bool = False  # with transparent: refuse the agents' traffic to other hosts
    sandbox: str | None = None  # rollout.sandbox: each episode in a sandbox of this backend (Harbor tasks always)
    sandbox_binds: list[str] = field(default_factory=list)  # host paths a sandboxed agent needs, bound read-only
    blocked_commands: list[str] = field(default_factory=list)  # commands refused (and flagged) in the sandbox
    roles: dict = field(default_factory=dict)  # the roles section's match, upstream, upstream_model,
    # upstream_key_env and train: the proxy names each call's role; only the learning role's samples go to verl

    @classmethod
    def from_mapping(cls, raw) -> LoopSettings:
        raw = dict(raw or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"the harness agent loop got unknown settings {unknown}; known: {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                         and f.name not in raw)
        if missing:
            raise ValueError(f"the harness agent loop needs the settings {missing} in its YAML entry's `harness:`")
        if isinstance(raw.get("command"), str):
            raw["command"] = shlex.split(raw["command"])
        raw["command"] = [str(c) for c in raw["command"]]
        raw["env"] = {str(k): str(v) for k, v in (raw.get("env") or {}).items()}
        return cls(**raw)


class HarnessAgentLoop(AgentLoopBase):
    """verl's agent loop for an unmodified agent: see the module docstring."""

    def __init__(self, *args, harness=None, **kwargs):
        super().__init__(*args, **kwargs)  # verl's `tools` land in its **kwargs, unused: our agents bring their own
        from omegaconf import DictConfig, OmegaConf

        raw = OmegaConf.to_container(harness, resolve=True) if isinstance(harness, DictConfig) else harness
        self.settings = LoopSettings.from_mapping(raw)
        self.prompt_length = self.rollout_config.prompt_length
        self.response_length = self.rollout_config.response_length

    async def run(self, sampling_params: dict, **kwargs) -> AgentLoopOutput | list[AgentLoopOutput]:
        bridge = await _Bridge.of(self.settings, self.server_manager, self.tokenizer)
        task = task_of(kwargs)
        sampling = SamplingOverrides(temperature=sampling_params.get("temperature"),
                                     top_p=sampling_params.get("top_p"), max_tokens_cap=self.settings.max_tokens)
        episode = await bridge.episode(task, sampling)
        outputs = self.outputs(episode, kwargs, bridge.versions_of(episode.episode_id))
        return outputs[0] if len(outputs) == 1 else outputs

    def outputs(self, episode: EpisodeResult, kwargs: dict, versions: tuple[int, int] = (0, 0)) \
            -> list[AgentLoopOutput]:
        """The episode's merged samples in verl's type (a list when its calls did not all extend each other).
        `versions`: the oldest and newest weight versions (verl's global_steps) that served the episode's calls;
        verl's trainer measures each trajectory's staleness with them."""
        reward = episode.reward if episode.reward is not None else 0.0
        judged = episode.status == FINISHED and episode.reward is not None and not episode.penalized
        roles = self.settings.roles
        learning = [(sample, episode.role_rewards.get(role, reward) if judged else reward)
                    for sample, role in zip(episode.samples, _padded(episode.sample_roles, len(episode.samples)),
                                            strict=True)
                    if learns(roles.get("train", ()), roles.get("upstream", {}), role)]
        extra = {"episode_id": episode.episode_id, "task_id": episode.task_id, "episode_status": episode.status,
                 "min_global_steps": versions[0], "max_global_steps": versions[1],
                 "reward_extra_info": {}}  # verl's v1 worker copies it from the last output to the others
        if not learning:  # no call of a learning role made it: one sample with nothing to learn keeps the group's size
            prompt = self._render(kwargs.get("raw_prompt")) or [self.tokenizer.eos_token_id]
            return [AgentLoopOutput(prompt_ids=prompt[-self.prompt_length:], response_ids=[self._pad_id()],
                                    response_mask=[0], response_logprobs=[0.0], reward_score=reward, num_turns=0,
                                    metrics={}, extra_fields={**extra, "cut_tokens": 0})]
        out = []
        for sample, sample_reward in learning:
            first = sample.loss_mask.index(1) if 1 in sample.loss_mask else len(sample.token_ids)
            prompt, response = sample.token_ids[:first], sample.token_ids[first:]
            mask, logprobs = sample.loss_mask[first:], sample.logprobs[first:]
            # verl pads to fixed lengths: what does not fit is cut, counted, and never trained on
            cut = max(0, len(prompt) - self.prompt_length) + max(0, len(response) - self.response_length)
            out.append(AgentLoopOutput(
                prompt_ids=prompt[-self.prompt_length:], response_ids=response[:self.response_length],
                response_mask=mask[:self.response_length], response_logprobs=logprobs[:self.response_length],
                reward_score=sample_reward, num_turns=2 * len(sample.call_ids), metrics={},
                extra_fields={**extra, "cut_tokens": cut}))
        return out

    def _render(self, messages) -> list[int]:
        if messages is None:
            return []
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                  **self.apply_chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id


def _padded(roles: list, n: int) -> list:
    return list(roles[:n]) + [None] * (n - len(roles))


def task_of(kwargs: dict) -> Task:
    """Our task from a verl sample: extra_info.task_json = {"task_id", "data", "split"}
    (trainer/rl/verl_backbone.py)."""
    extra = kwargs.get("extra_info")
    raw = extra.get("task_json") if isinstance(extra, dict) else None
    try:
        task = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        task = None
    if not isinstance(task, dict) or "task_id" not in task or not isinstance(task.get("data"), dict):
        raise ValueError("a verl sample for the harness agent loop needs extra_info.task_json, a JSON object "
                         "{task_id, data, split} (trainer.rl.verl_backbone.write_dataset writes it); this sample has "
                         f"{sorted(kwargs)} and extra_info {sorted(extra) if isinstance(extra, dict) else extra!r}")
    return Task(str(task["task_id"]), task["data"], str(task.get("split") or "train"))


class _Bridge:
    """Per worker process: the TokenEngine over verl's generate, the recording proxy with its runner, and one judge
    pool that judges every episode of the worker (so an episode costs no process start)."""

    _by_dir: dict[str, _Bridge] = {}
    _lock: asyncio.Lock | None = None
    _lock_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def of(cls, settings: LoopSettings, server_manager, tokenizer) -> _Bridge:
        loop = asyncio.get_running_loop()
        if cls._lock is None or cls._lock_loop is not loop:  # one loop per worker; a test runs several in turn
            cls._lock, cls._lock_loop = asyncio.Lock(), loop
        async with cls._lock:
            bridge = cls._by_dir.get(settings.run_dir)
            if bridge is None:
                bridge = cls(settings, server_manager, tokenizer)
                await bridge._start()
                cls._by_dir[settings.run_dir] = bridge
            return bridge

    def __init__(self, settings: LoopSettings, server_manager, tokenizer):
        self.settings = settings
        self.server_manager = server_manager
        self.engine = TokenEngine(self._generate, tokenizer, model=settings.served_model,
                                  max_model_len=settings.max_model_len, tool_parser=settings.tool_parser,
                                  reasoning_parser=settings.reasoning_parser)
        self.rollouts: Rollouts | None = None
        self.judges: JudgePool | None = None  # used on the proxy's loop only, where every collect runs its episodes
        self.pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="harness-episode")
        self._count = 0
        self._versions: dict[str, tuple[int, int]] = {}  # episode id -> oldest, newest weight version that served it
        self._latest = 0  # the newest weight version a server answered with

    async def _start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        if s.judge is not None:  # first: a judge spec that cannot be loaded fails the episode before anything starts
            self.judges = await loop.run_in_executor(
                self.pool, lambda: JudgePool(s.judge, workers=s.judge_workers, timeout_s=s.judge_timeout_s))
        atexit.register(self.close)
        url = await self.engine.start()
        run = RunConfig(command=s.command, judge=s.judge, repeat=1, concurrency=1, timeout_s=s.timeout_s,
                        retries=s.retries, judge_timeout_s=s.judge_timeout_s, judge_workers=s.judge_workers,
                        cwd=Path(s.cwd) if s.cwd else None, env=dict(s.env), memory_mb=s.memory_mb or None,
                        max_procs=s.max_procs or None, sandbox=s.sandbox, sandbox_binds=tuple(s.sandbox_binds),
                        blocked_commands=tuple(s.blocked_commands))
        run_dir = Path(s.run_dir) / "verl" / f"worker-{os.getpid()}"
        run_dir.mkdir(parents=True, exist_ok=True)
        engine = Engine(base_url=url, served_model=s.served_model, returns_token_ids=True, tool_parser=s.tool_parser,
                        reasoning_parser=s.reasoning_parser, model_dir=self.engine.parsing_model)
        r = s.roles
        rules = parse_rules(r.get("match") or {}, r.get("upstream"), r.get("upstream_model"), r.get("upstream_key_env"))
        train, upstream = tuple(r.get("train") or ()), dict(r.get("upstream") or {})
        # In a thread: the proxy asks the TokenEngine (on this loop) for its model while it starts.
        self.rollouts = await loop.run_in_executor(
            self.pool, lambda: Rollouts(engine, run_dir, run, sampling=SamplingOverrides(),
                                        token_exact=s.token_exact, reasoning_history=s.reasoning_history,
                                        guard=guard_of(s.guard), roles=rules, interceptor=interceptor_for(s, run_dir),
                                        max_turns=s.max_turns, max_samples=s.max_samples_per_episode,
                                        penalty=s.guard.get("penalty"),
                                        learns=lambda role: learns(train, upstream, role)))

    def close(self) -> None:
        """Stop the proxy, then the judge pool (at process exit, or by whoever made the bridge). Idempotent."""
        if self.rollouts is not None:
            self.rollouts.close()
        if self.judges is not None:
            self.judges.close()

    async def _generate(self, prompt_ids: list[int], sampling: dict, episode_id: str | None) -> Generated:
        out = await self.server_manager.generate(request_id=episode_id or uuid.uuid4().hex, prompt_ids=prompt_ids,
                                                 sampling_params=sampling)
        logprobs = list(out.log_probs) if out.log_probs is not None else None
        self._note_versions(episode_id, out.extra_fields or {})
        return Generated(list(out.token_ids), logprobs, aborted=out.stop_reason == "aborted")

    def _note_versions(self, episode_id: str | None, fields: dict) -> None:
        newest = fields.get("max_global_steps", fields.get("global_steps"))
        oldest = fields.get("min_global_steps", newest)
        if newest is None or episode_id is None:
            return
        self._latest = max(self._latest, int(newest))
        seen = self._versions.get(episode_id)
        self._versions[episode_id] = (int(oldest), int(newest)) if seen is None else \
            (min(seen[0], int(oldest)), max(seen[1], int(newest)))

    def versions_of(self, episode_id: str) -> tuple[int, int]:
        """The weight versions that served an episode's calls (forgotten once asked); an episode none of whose
        calls reached a server gets the newest version seen, as if it had been served now."""
        return self._versions.pop(episode_id, (self._latest, self._latest))

    async def episode(self, task: Task, sampling: SamplingOverrides) -> EpisodeResult:
        """Run one episode of the agent on `task` (its own run in episode_outcomes), judged and merged. Sampling is
        set per collect: verl runs training and validation batches one after the other, never mixed."""
        self._count += 1
        step = await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda n=self._count: self.rollouts.collect(n, [task], tag="verl", repeat=1, sampling=sampling,
                                                                   judge_pool=self.judges))
        return step.episodes[0]
