"""`backbone: verl` on the real engine: verl's agent-loop contract run with adapters/verl_loop.py."""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from harness.running.tasks import read_tasks
from tests.adapters.test_verl import _config
from tests.support import db_rows
from trainer.maths.algorithms import outcome_advantages, token_advantages

ROOT = Path(__file__).resolve().parents[2]
needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")
_VERL = "prompt_length: 128, response_length: 160, nnodes: 2, n_gpus_per_node: 4"

# ------------------------------------------------------------------------------------------- the contract test
def _client_class():
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import TokenOutput

    class VllmClient(LLMServerClient):
        """verl's LLM server client, served by a running vLLM over HTTP: token in, token out."""

        def __init__(self, config, base_url: str, model: str):
            super().__init__(config, load_balancer_handle=None)
            self.base_url, self.model = base_url, model
            self.request_ids: list[str] = []

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
            self.request_ids.append(request_id)
            sp = dict(sampling_params)
            body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": sp.pop("max_tokens"),
                    "logprobs": 0 if sp.pop("logprobs", False) else None, "return_token_ids": True,
                    "add_special_tokens": False, **sp}
            async with aiohttp.ClientSession() as session, \
                    session.post(f"{self.base_url}/v1/completions", json=body) as resp:
                out = await resp.json()
                assert resp.status == 200, out
            choice = out["choices"][0]
            logprobs = choice["logprobs"]["token_logprobs"] if choice.get("logprobs") else None
            return TokenOutput(token_ids=choice["token_ids"], log_probs=logprobs, stop_reason="completed")

    return VllmClient


async def _verl_batch(tmp_path: Path, cfg, engine, before=lambda: None, after=lambda: None):
    """One batch of 2 tasks through verl's AgentLoopWorker (what AgentLoopManager runs as a Ray actor) made from the
    config our translation produces, its batch made by verl's own dataset code, its LLM client served by the engine.
    Returns verl's output DataProto, the client, and the worker's DuckDB file; `before` runs after the worker is
    made, before the batch, and `after` after the batch, before the worker's bridge is closed."""
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    import adapters.verl_loop as verl_loop
    from trainer.rl.verl_backbone import VerlFiles, verl_config, write_agent_loop, write_dataset

    run_dir = tmp_path / "run"
    tasks = read_tasks(cfg.data.train, limit=2)
    files = VerlFiles(write_dataset(tasks, tmp_path / "train.parquet"), None,
                      write_agent_loop(cfg, run_dir, tmp_path / "agent_loop.yaml"), tmp_path / "ck")
    config = verl_config(cfg, files)
    client = _client_class()(config, engine.base_url, engine.served_model)
    worker = AgentLoopWorker(config, llm_client=client)
    before()
    # a training batch as verl's trainer makes one: its dataset, its collate_fn, a uid per prompt, repeated n times
    dataset = RLHFDataset(data_files=[str(files.train)], tokenizer=worker.tokenizer, config=config.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[k] for k in range(len(dataset))]))
    batch.non_tensor_batch["uid"] = np.array([uuid.uuid4().hex for _ in range(len(batch))], dtype=object)
    batch = batch.repeat(repeat_times=config.actor_rollout_ref.rollout.n, interleave=True)
    try:
        out = await worker.generate_sequences(batch)
        after()
    finally:
        for bridge in verl_loop._Bridge._by_dir.values():
            bridge.close()
        verl_loop._Bridge._by_dir.clear()
    [db] = list((run_dir / "verl").glob("worker-*/harness.duckdb"))
    return out, client, db


@needs_verl
async def test_agent_loop_contract_with_verl(tmp_path, engine, tiny_model_dir, monkeypatch):
    from verl.trainer.ppo import core_algos

    import adapters.verl_loop as verl_loop
    import harness.running.runner

    pools = []  # every judge pool made, by the bridge or by a runner: one per worker, shared by its episodes

    class CountedPool(verl_loop.JudgePool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    def count_pools():
        monkeypatch.setattr(verl_loop, "JudgePool", CountedPool)
        monkeypatch.setattr(harness.running.runner, "JudgePool", CountedPool)

    def one_pool_open():
        assert len(pools) == 1 and pools[0].worker_pids, "one judge pool for the worker, open for its next batch"

    out, client, db = await _verl_batch(tmp_path, _config(tmp_path, tiny_model_dir), engine, before=count_pools,
                                        after=one_pool_open)
    assert pools[0].worker_pids == []  # closed with its bridge

    n, p_len, r_len = 4, 128, 160
    assert out.batch["prompts"].shape == (n, p_len) and out.batch["responses"].shape == (n, r_len)
    assert out.batch["input_ids"].shape == out.batch["attention_mask"].shape == (n, p_len + r_len)
    assert out.batch["rollout_log_probs"].shape == out.batch["response_mask"].shape == (n, r_len)
    episodes = list(out.non_tensor_batch["episode_id"])
    assert len(set(episodes)) == n and set(out.non_tensor_batch["episode_status"]) == {"finished"}

    # every row is exactly the episode's merged sample as recorded in DuckDB: ids, mask, the engine's logprobs
    rewards = []
    for k, episode_id in enumerate(episodes):
        [(tokens, mask, logprobs, reward)] = db_rows(db, "SELECT token_ids, loss_mask, logprobs, reward FROM samples "
                                                     "WHERE episode_id = ?", [episode_id])
        first = mask.index(1)
        attn = out.batch["attention_mask"][k].bool()
        assert out.batch["input_ids"][k][attn].tolist() == tokens  # left-padded prompt + right-padded response
        assert out.batch["prompts"][k][-first:].tolist() == tokens[:first]
        response_len = len(tokens) - first
        assert out.batch["response_mask"][k][:response_len].tolist() == mask[first:]
        assert out.batch["response_mask"][k][response_len:].sum() == 0
        assert 0 in mask[first:], "two turns: the follow-up question sits between generated tokens, masked out"
        lp = out.batch["rollout_log_probs"][k][:response_len]
        assert torch.allclose(lp, torch.tensor(logprobs[first:], dtype=lp.dtype), atol=1e-6)
        assert out.batch["rm_scores"][k].sum().item() == pytest.approx(reward)
        assert out.batch["rm_scores"][k][response_len - 1].item() == pytest.approx(reward)  # at the last token
        rewards.append(reward)
    calls = db_rows(db, "SELECT count(*), count(DISTINCT episode_id), min(array_length(prompt_ids)) FROM calls "
                    "WHERE status = 'ok'")
    assert calls[0][:2] == (2 * n, n) and calls[0][2] > 0  # two turns per episode, all recorded with engine ids
    assert len(client.request_ids) == 2 * n and set(client.request_ids) == set(episodes)  # sticky per episode

    # GRPO advantages with verl's own function, on verl's batch: zero off the mask, one value per sequence on it
    mask = out.batch["response_mask"]
    adv, _ = core_algos.compute_grpo_outcome_advantage(token_level_rewards=out.batch["rm_scores"],
                                                       response_mask=mask, index=out.non_tensor_batch["uid"])
    assert adv.shape == (n, r_len) and (adv[mask == 0] == 0).all()
    ours = token_advantages(outcome_advantages(torch.tensor(rewards), list(out.non_tensor_batch["uid"])), mask)
    assert torch.allclose(adv, ours, atol=1e-4)


@needs_verl
async def test_only_the_learning_role_reaches_verl(tmp_path, engine, tiny_model_dir):
    """Selective training with verl: the unmodified two-agent app (planner and executor, told apart by the model
    each asks for), only the executor learning. verl gets exactly the executor's merged sample of each episode,
    with the judge's reward for the executor; the planner's calls are recorded, with their role, and not sent."""
    app = ROOT / "examples" / "planner_executor"
    cfg = _config(tmp_path, tiny_model_dir, "  roles: {match: {planner: 'model:gpt-4o', executor: "
                  "'model:gpt-4o-mini'}, train: [executor]}", agent=app / "agent.py", tasks=app / "train.jsonl",
                  judge=f"{app / 'judge.py'}:planner_and_executor")
    out, _, db = await _verl_batch(tmp_path, cfg, engine)
    episodes = list(out.non_tensor_batch["episode_id"])
    assert len(episodes) == 4 and len(set(episodes)) == 4  # one output per episode: the executor's sample
    assert db_rows(db, "SELECT role, count(*) FROM calls GROUP BY role ORDER BY role") == [("executor", 4),
                                                                                           ("planner", 4)]
    for k, episode_id in enumerate(episodes):
        rows = db_rows(db, "SELECT s.token_ids, s.loss_mask, c.role FROM samples s JOIN calls c "
                           "ON c.call_id = s.call_ids[1] WHERE s.episode_id = ?", [episode_id])
        [(tokens, mask)] = [(t, m) for t, m, role in rows if role == "executor"]
        attn = out.batch["attention_mask"][k].bool()
        assert out.batch["input_ids"][k][attn].tolist() == tokens
        [(details,)] = db_rows(db, "SELECT details FROM judgements WHERE episode_id = ?", [episode_id])
        executor_reward = json.loads(details)["role_rewards"]["executor"]
        assert out.batch["rm_scores"][k].sum().item() == pytest.approx(executor_reward)


@needs_verl
async def test_transparent_mode_through_verl_s_agent_loop(tmp_path, engine, tiny_model_dir):
    """rollout.transparent with verl: the black-box agent hard-codes https://api.openai.com and never reads
    OPENAI_BASE_URL, yet its calls reach verl's rollout server through the worker's mitmproxy hop and proxy, are
    recorded with the engine's ids, and verl gets their merged samples."""
    cfg = _config(tmp_path, tiny_model_dir, agent=ROOT / "examples" / "blackbox_agent" / "agent.py",
                  rollout=" transparent: true, max_tokens: 6,")
    out, client, db = await _verl_batch(tmp_path, cfg, engine)
    episodes = list(out.non_tensor_batch["episode_id"])
    assert len(set(episodes)) == 4 and set(out.non_tensor_batch["episode_status"]) == {"finished"}
    calls = db_rows(db, "SELECT count(*), count(DISTINCT episode_id) FROM calls WHERE status = 'ok' "
                        "AND token_source = 'engine'")
    assert calls[0][1] == 4 and calls[0][0] == len(client.request_ids) >= 4  # every call went through verl's client
    assert (db.parent / "transparent.log").exists()
    for k, episode_id in enumerate(episodes):
        [(tokens,)] = db_rows(db, "SELECT token_ids FROM samples WHERE episode_id = ?", [episode_id])
        assert out.batch["input_ids"][k][out.batch["attention_mask"][k].bool()].tolist() == tokens


SANDBOXED_AGENT = '''
import json, sys
from openai import OpenAI
task = json.loads(sys.stdin.read())
reply = OpenAI().chat.completions.create(model="gpt-4o-mini", max_tokens=16,
                                         messages=[{"role": "user", "content": task["prompt"]}])
open("answer.txt", "w").write(reply.choices[0].message.content or "")
print(json.dumps({"answer": "written"}))
'''


@needs_verl
async def test_harbor_tasks_through_verl_s_agent_loop_run_sandboxed(tmp_path, engine, tiny_model_dir):
    """`backbone: verl` over Harbor tasks: each agent-loop episode runs in its sandbox on the worker's own machine
    and is judged by the task's tests/test.sh; verl gets the verifier's reward on the episode's sample."""
    for k, name in enumerate(("first", "second")):
        task = tmp_path / "tasks" / name
        (task / "tests").mkdir(parents=True)
        (task / "instruction.md").write_text(f"Say something about the number {k}.\n")
        reward = "1" if k == 0 else "0.25"  # the verifier's number, whatever the random model wrote
        (task / "tests" / "test.sh").write_text(f"[ -f /app/answer.txt ] && echo {reward} > /logs/verifier/reward.txt"
                                                "\n")
    agent = tmp_path / "agent.py"
    agent.write_text(SANDBOXED_AGENT)
    cfg = _config(tmp_path, tiny_model_dir, agent=agent, tasks=tmp_path / "tasks", judge="null",
                  rollout=" blocked_commands: [git],")
    out, _, db = await _verl_batch(tmp_path, cfg, engine)
    episodes = list(out.non_tensor_batch["episode_id"])
    assert len(episodes) == 4 and set(out.non_tensor_batch["episode_status"]) == {"finished"}
    for k, episode_id in enumerate(episodes):
        [(task_id, backend, judge, reward)] = db_rows(
            db, "SELECT o.task_id, o.sandbox->>'backend', j.judge, j.reward FROM episode_outcomes o "
                "JOIN judgements j USING (episode_id) WHERE episode_id = ?", [episode_id])
        assert (backend, judge, reward) == ("bwrap", "harbor:tests/test.sh", 1.0 if task_id == "first" else 0.25)
        assert out.batch["rm_scores"][k].sum().item() == pytest.approx(reward)
