"""Training without rollouts (trainer/offline/loop.py): `harness train --from-run RUN` on a recorded run's episodes, and
`harness sft` on chat records, through the real CLI on the tiny model.

Runs are recorded for real (`harness run` of the unmodified terse agent through the proxy): in front of the
scripted engine (answering like vLLM, or like a hosted API without token ids) for the fast tier, in front of vLLM
serving the tiny model for the acceptance test of the engine tier.
The tests on the real engine are in test_offline_engine.py."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proxy.scripted_engine import Script
from tests.support import TERSE, ScriptedUpstream, db_rows

ROOT = Path(__file__).resolve().parents[2]
TERSE_YAML = ROOT / "examples" / "train" / "terse.yaml"

JUDGE = '''
import random


def spread(task, answer, calls):
    """Rewards that differ within a task's group (the scripted engine answers every call alike)."""
    return random.random()
'''


def _record(run_dir: Path, upstream_url: str, judge: str, *, limit: int, repeat: int, agent: Path = TERSE / "agent.py",
            data: Path = TERSE / "tasks.jsonl", more: tuple[str, ...] = ()) -> tuple[Path, str]:
    """`harness run` of `agent` (the terse one by default) over `data` in front of `upstream_url`; the database and
    the run's id. `more`: further flags (--role ...)."""
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(agent), "--data", str(data), "--limit",
                          str(limit), "--judge", judge, "--repeat", str(repeat), "--upstream", upstream_url,
                          "--run-dir", str(run_dir), "--concurrency", "8", *more],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    db = run_dir / "harness.duckdb"
    (run_id,), = db_rows(db, "SELECT DISTINCT run_id FROM episode_outcomes")
    return db, run_id


def _scripted_run(tmp: Path, token_ids: bool) -> tuple[Path, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    judge = tmp / "spread.py"
    judge.write_text(JUDGE)
    upstream = ScriptedUpstream(Script(token_ids=token_ids))
    try:
        return _record(tmp / "runs", upstream.url, f"{judge}:spread", limit=4, repeat=3)
    finally:
        upstream.close()


def _cli(verb: str, model: Path, out: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`harness VERB examples/train/terse.yaml` on `model`, its run directory under `out`."""
    return subprocess.run([sys.executable, "-m", "harness.cli", verb, str(TERSE_YAML), f"--set=model.path={model}",
                           f"--set=logging.run_dir={out}", "--set=experiment_name=offline",
                           "--set=logging.console=false", "--set=logging.curve_png=false", *args],
                          capture_output=True, text=True, timeout=timeout)


def _refused(capsys, verb: str, model: Path, out: Path, *args: str) -> str:
    """`harness VERB ...` run in this process, for a refusal that comes before any training: its error text."""
    from harness.cli.main import main

    rc = main([verb, str(TERSE_YAML), f"--set=model.path={model}", f"--set=logging.run_dir={out}",
               "--set=experiment_name=offline", "--set=logging.console=false", "--set=logging.curve_png=false", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    return err


def _metric(out: Path, name: str) -> dict[int, float]:
    return dict(db_rows(out / "offline" / "harness.duckdb", "SELECT step, value FROM metrics WHERE name = ? "
                        "ORDER BY step", [name]))


@pytest.fixture(scope="module")
def engine_ids_run(tmp_path_factory) -> tuple[Path, str]:
    """A run recorded in front of an upstream answering like vLLM (ids, logprobs of -0.5), judged at random."""
    return _scripted_run(tmp_path_factory.mktemp("engine-ids"), token_ids=True)


# ---------------------------------------------------------------------------------------------- harness sft


CHAT = [
    {"messages": [{"role": "system", "content": "Answer in one short word."},
                  {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris"},
                  {"role": "user", "content": "And why?"},
                  {"role": "assistant", "content": "History"}]},
    {"messages": [{"role": "user", "content": "What is 6 times 7?"},
                  {"role": "assistant", "content": "Let me compute.", "weight": 0,
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "calc", "arguments": "{\"expr\": \"6*7\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "42"},
                  {"role": "assistant", "content": "42"}],
     "tools": [{"type": "function", "function": {"name": "calc", "description": "evaluate",
                                                 "parameters": {"type": "object",
                                                                "properties": {"expr": {"type": "string"}}}}}]},
    {"prompt": [{"role": "user", "content": "Say yes."}], "completion": [{"role": "assistant", "content": "yes"}]},
]


def test_sft_on_chat_records_lowers_their_loss_and_writes_a_model_transformers_loads(tiny_model_dir, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT * 4))
    done = _cli("sft", tiny_model_dir, tmp_path / "runs", f"--data={data}", "--set=offline.epochs=3",
                "--set=offline.batch_size=4", "--set=trainer.lr=3e-3")
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "runs"
    assert _metric(out, "offline/records") == {0: 12.0}
    assert _metric(out, "offline/samples") == {0: 12.0}
    nll = _metric(out, "offline/data_nll")  # before the first step, and after each of the 3 epochs
    assert sorted(nll) == [0, 3, 6, 9]
    assert nll[0] > nll[3] > nll[6] > nll[9]
    assert nll[9] < 0.7 * nll[0]

    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "offline" / "hf")
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), original.state_dict().values(),
                                                      strict=True))


# How far apart the weights of one process and of two ranks may end, as a share of how far training moved them
# (test_sft_on_two_fsdp_ranks_...): the largest difference against the largest move, and the norms of both.
# Measured on a 2-core machine: 0.21% and 0.0007% (3.9e-5 and a norm 7e-6 of the moves' ~1.8e-2 and its norm);
# the run that failed a fixed 1e-4 elsewhere was at ~0.56%. The bounds leave ~9x and ~140x over those.
MAX_SPREAD, NORM_SPREAD = 0.05, 1e-3


def test_sft_on_two_fsdp_ranks_makes_the_updates_of_one_process(tiny_model_dir, tmp_path):
    """Each rank trains its share of every batch (a rank left without rows runs a zero-weight pass): the metrics
    and the final weights equal one process's."""
    from safetensors.torch import load_file

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT * 3))  # 9 records: the last batch of 4 has 1
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"ranks{n}"
        done = _cli("sft", tiny_model_dir, out, f"--data={data}", "--set=offline.epochs=2",
                    "--set=offline.batch_size=4", "--set=trainer.lr=3e-3", f"--set=trainer.fsdp.nprocs={n}")
        assert done.returncode == 0, done.stderr[-3000:]
        runs[n] = (_metric(out, "offline/data_nll"), _metric(out, "offline/nll"),
                   load_file(out / "offline" / "hf" / "model.safetensors"))
    (nll1, batch1, weights1), (nll2, batch2, weights2) = runs[1], runs[2]
    assert sorted(batch1) == sorted(batch2) == list(range(1, 7))
    for one, two in ((nll1, nll2), (batch1, batch2)):
        assert one.keys() == two.keys()
        assert all(abs(one[k] - two[k]) <= 1e-4 * abs(one[k]) for k in one), (one, two)
    assert weights1.keys() == weights2.keys()
    # The two runs add each gradient up in a different order, in float32: two ranks all-reduce their halves, and
    # under torchrun each rank computes on one thread, so even a matmul's blocking differs from one process's.
    # AdamW then divides each gradient by its running RMS: where a gradient nearly cancels, the rounding is a
    # large part of it and that weight's step (~lr) can differ by a good part of itself. So the differences are
    # measured against how far training moved the weights, not against a fixed number: a machine with another
    # core count rounds otherwise (1.0e-4 absolute was seen beside a ~1.8e-2 move: MAX_SPREAD says more), while a
    # rank that trained the wrong rows or weights would differ by about as much as the weights moved.
    original = load_file(tiny_model_dir / "model.safetensors")
    moved = torch.cat([(weights1[k] - original[k]).flatten() for k in weights1 if k in original])
    apart = torch.cat([(weights1[k] - weights2[k]).flatten() for k in weights1 if k in original])
    spread = {"max": (apart.abs().max() / moved.abs().max()).item(), "norm": (apart.norm() / moved.norm()).item()}
    assert spread["max"] <= MAX_SPREAD and spread["norm"] <= NORM_SPREAD, spread


def test_sft_with_lora_trains_the_adapter_and_writes_it_as_vllm_loads_it(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    done = _cli("sft", tiny_model_dir, tmp_path, f"--data={data}", "--set=trainer.lora.rank=4",
                "--set=trainer.lr=1e-2", "--set=offline.epochs=2")
    assert done.returncode == 0, done.stderr[-3000:]
    adapter = tmp_path / "offline" / "adapter"
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and all("lora_" in k for k in weights)
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)  # B starts at 0: it was trained
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    assert not (tmp_path / "offline" / "hf").exists()


def test_a_checkpoint_is_continued_only_by_a_run_of_its_kind_over_its_data(tiny_model_dir, tmp_path, capsys):
    """runs/<experiment>/checkpoints is shared by harness train, --from-run and harness sft: a run continues a
    checkpoint only if the same kind of run over the same data wrote it."""
    data, other = tmp_path / "chat.jsonl", tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT * 4))
    other.write_text("".join(json.dumps(r) + "\n" for r in CHAT[:2] * 4))
    first = _cli("sft", tiny_model_dir, tmp_path, f"--data={data}", "--set=offline.batch_size=4")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _cli("sft", tiny_model_dir, tmp_path, f"--data={data}", "--set=offline.batch_size=4")
    assert again.returncode == 0 and "continuing with step 4 of 3" in again.stderr  # done already: nothing to run
    assert sorted(_metric(tmp_path, "offline/nll")) == [1, 2, 3]
    refused = _refused(capsys, "sft", tiny_model_dir, tmp_path, f"--data={other}", "--set=offline.batch_size=4")
    assert "other data" in refused and "trainer.resume=disable" in refused
    assert "a sft run" in _refused(capsys, "train", tiny_model_dir, tmp_path)


def test_sft_refuses_bad_input_with_what_to_do(tiny_model_dir, tmp_path, capsys):
    assert "offline.data" in _refused(capsys, "sft", tiny_model_dir, tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "plain text", "completion": "more text"}) + "\n")
    assert "record 0" in _refused(capsys, "sft", tiny_model_dir, tmp_path, f"--data={bad}")
    pg = _refused(capsys, "sft", tiny_model_dir, tmp_path, f"--data={bad}", "--set=offline.loss=pg")
    assert "harness train --from-run" in pg
    ranks = _refused(capsys, "sft", tiny_model_dir, tmp_path, f"--data={bad}", "--set=trainer.fsdp.nprocs=2")
    assert ranks.count("record 0") == 1  # said once, by the launcher, before any rank starts
    assert "--from-run" in _refused(capsys, "train", tiny_model_dir, tmp_path, "--where=reward >= 1")


# ---------------------------------------------------------------------------------------------- --from-run


def test_from_run_sft_trains_the_kept_episodes_tokens_exactly(engine_ids_run, tiny_model_dir, tmp_path):
    db, run_id = engine_ids_run
    kept = db_rows(db, "SELECT count(*) FROM (SELECT episode_id, arg_max(reward, created_at) r FROM judgements "
                   "GROUP BY 1) WHERE r >= 0.5")[0][0]
    assert 0 < kept < 12
    done = _cli("train", tiny_model_dir, tmp_path, f"--from-run={run_id}", f"--db={db}", "--where=reward >= 0.5",
                "--set=offline.batch_size=4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _metric(tmp_path, "offline/episodes") == {0: kept}
    samples = db_rows(db, "SELECT sum(n_trainable) FROM samples WHERE episode_id IN (SELECT episode_id FROM "
                      "judgements GROUP BY 1 HAVING arg_max(reward, created_at) >= 0.5)")[0][0]
    assert _metric(tmp_path, "offline/tokens_trained") == {0: samples}  # the sampled tokens, as merged when recorded
    assert len(_metric(tmp_path, "offline/nll")) == -(-int(_metric(tmp_path, "offline/samples")[0]) // 4)


def test_from_run_reads_a_database_a_proxy_is_still_recording_into(engine_ids_run, tiny_model_dir, tmp_path):
    """DuckDB lets one process open the file: the run is read through the proxy's read-only SQL route."""
    import time

    from harness.store.live import info_path

    db = tmp_path / "live.duckdb"
    shutil.copy(engine_ids_run[0], db)
    upstream = ScriptedUpstream()
    serve = subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", "--upstream", upstream.url, "--port", "0",
                              "--db", str(db), "--run-dir", str(tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not info_path(db).exists() and serve.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert info_path(db).exists(), "harness serve did not announce itself"
        done = _cli("train", tiny_model_dir, tmp_path, f"--from-run={engine_ids_run[1]}", f"--db={db}",
                    "--where=reward >= 0.5")
    finally:
        serve.send_signal(signal.SIGINT)
        serve.communicate(timeout=30)
        upstream.close()
    assert done.returncode == 0, done.stderr[-3000:]
    closed = _cli("train", tiny_model_dir, tmp_path / "closed", f"--from-run={engine_ids_run[1]}", f"--db={db}",
                  "--where=reward >= 0.5")
    assert closed.returncode == 0, closed.stderr[-3000:]
    for name in ("offline/episodes", "offline/tokens_trained", "offline/data_nll"):
        assert _metric(tmp_path, name)[0] == pytest.approx(_metric(tmp_path / "closed", name)[0], rel=1e-6), name


def test_from_run_pg_weighs_tokens_by_trained_over_sampling_probability_and_says_when_they_disagree(
        engine_ids_run, tiny_model_dir, tmp_path):
    """The scripted engine's logprobs (-0.5 a token) are not the tiny model's: the ratio is far from 1 from the
    first step, and the run says so."""
    db, run_id = engine_ids_run
    done = _cli("train", tiny_model_dir, tmp_path, f"--from-run={run_id}", f"--db={db}", "--set=offline.loss=pg")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "differ from the run's stored ones" in done.stderr
    diff = _metric(tmp_path, "logprob/behaviour_mean_abs_diff")[1]
    assert diff > 1.0
    ratio = _metric(tmp_path, "actor/ratio_mean")[1]
    assert ratio < 0.1  # the tiny model finds the scripted tokens far less likely than exp(-0.5)


def test_from_run_with_a_policy_per_role_trains_each_adapter_on_its_roles_samples(tiny_model_dir, tmp_path):
    """examples/planner_executor recorded with its roles named (harness run --role), then trained offline as
    examples/train/planner_executor.yaml says: one LoRA adapter per role, each stepped on its role's samples."""
    from safetensors.torch import load_file

    example, config = ROOT / "examples/planner_executor", ROOT / "examples/train/planner_executor.yaml"
    judge = tmp_path / "spread.py"
    judge.write_text(JUDGE)
    upstream = ScriptedUpstream(Script(token_ids=True))
    try:
        db, run_id = _record(tmp_path / "rec", upstream.url, f"{judge}:spread", limit=3, repeat=3,
                             agent=example / "agent.py", data=example / "train.jsonl",
                             more=("--role", "planner=model:gpt-4o", "--role", "executor=model:gpt-4o-mini"))
    finally:
        upstream.close()
    done = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(config), f"--from-run={run_id}",
                           f"--db={db}", f"--set=model.path={tiny_model_dir}", f"--set=logging.run_dir={tmp_path}",
                           "--set=experiment_name=offline", "--set=trainer.lora.rank=8", "--set=trainer.lr=1e-2",
                           "--set=offline.batch_size=64", "--set=data.validation=null",
                           "--set=trainer.val_before_train=false", "--set=trainer.test_freq=0",
                           "--set=logging.console=false", "--set=logging.curve_png=false"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for role in ("planner", "executor"):  # each role's 9 calls, one sample each
        assert _metric(tmp_path, f"policy/{role}/offline/samples") == {0: 9.0}, role
        assert _metric(tmp_path, f"policy/{role}/actor/grad_norm")[1] > 0, role
        nll = _metric(tmp_path, f"policy/{role}/offline/data_nll")
        assert sorted(nll) == [0, 1] and nll[1] < nll[0], (role, nll)
    assert not _metric(tmp_path, "actor/grad_norm")  # per policy only
    trained = {role: load_file(tmp_path / "offline" / "adapter" / role / "adapter_model.safetensors")
               for role in ("planner", "executor")}
    for role, state in trained.items():  # B starts at zero: each adapter moved
        assert any(k.endswith("lora_B.weight") and state[k].abs().sum() > 0 for k in state), role
    planner, executor = trained["planner"], trained["executor"]
    assert planner.keys() == executor.keys() and any(not torch.equal(planner[k], executor[k]) for k in planner)


def test_from_run_refuses_what_it_cannot_train_with_what_to_do(engine_ids_run, tiny_model_dir, tmp_path, capsys):
    db, run_id = engine_ids_run
    unknown = _refused(capsys, "train", tiny_model_dir, tmp_path, "--from-run=nope", f"--db={db}")
    assert "'nope'" in unknown and run_id in unknown
    args = (f"--from-run={run_id}", f"--db={db}")
    assert "keeps none" in _refused(capsys, "train", tiny_model_dir, tmp_path, *args, "--where=reward > 2")
    _refused(capsys, "train", tiny_model_dir, tmp_path, *args, "--where=1; DROP TABLE calls")
    kl = _refused(capsys, "train", tiny_model_dir, tmp_path, *args, "--set=trainer.kl_coef=0.1")
    assert "trainer.kl_coef=0" in kl
    gae = _refused(capsys, "train", tiny_model_dir, tmp_path, *args, "--set=offline.loss=pg",
                   "--set=trainer.adv_estimator=gae")
    assert "needs a critic" in gae
    assert db_rows(db, "SELECT count(*) FROM calls")[0][0] == 24  # nothing recorded was touched


def test_text_only_calls_train_only_once_retokenized_and_explicitly_allowed(tiny_model_dir, tmp_path, capsys):
    db, run_id = _scripted_run(tmp_path / "hosted", token_ids=False)
    args = (f"--from-run={run_id}", f"--db={db}")
    assert "harness retokenize" in _refused(capsys, "train", tiny_model_dir, tmp_path / "a", *args)

    retokenize = subprocess.run([sys.executable, "-m", "harness.cli", "retokenize", "--model", str(tiny_model_dir),
                                 "--db", str(db)], capture_output=True, text=True, timeout=120)
    assert retokenize.returncode == 0, retokenize.stderr
    assert "offline.allow_retokenized: true" in _refused(capsys, "train", tiny_model_dir, tmp_path / "b", *args)
    pg = _refused(capsys, "train", tiny_model_dir, tmp_path / "c", *args, "--set=offline.allow_retokenized=true",
                  "--set=offline.loss=pg")
    assert "no sampling logprobs" in pg

    allowed = _cli("train", tiny_model_dir, tmp_path / "d", *args, "--set=offline.allow_retokenized=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    retokenized = db_rows(db, "SELECT sum(len(completion_ids)) FROM choices")[0][0]
    assert _metric(tmp_path / "d", "offline/tokens_trained") == {0: retokenized}  # every reply, once

    # Or, without retokenizing: export the run as chat records, and fine-tune on them with harness sft.
    chat = tmp_path / "chat.parquet"
    exported = subprocess.run([sys.executable, "-m", "harness.cli", "export", "--db", str(db), "--run", run_id,
                               "--format", "parquet", "--out", str(chat)], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    sft = _cli("sft", tiny_model_dir, tmp_path / "e", f"--data={chat}")
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert _metric(tmp_path / "e", "offline/samples") == {0: 12}  # one conversation per episode
    assert _metric(tmp_path / "e", "offline/tokens_trained") == {0: retokenized}  # the same tokens, the same template


# ---------------------------------------------------------------------------------------------- the acceptance test


# ---------------------------------------------------------------------------------------------- the parts


def test_pg_groups_each_episode_with_its_task_in_its_own_step():
    from trainer.config import load_config
    from trainer.offline.data import _advantages

    cfg = load_config(TERSE_YAML, ["model.path=/nowhere", "offline.run=r", "offline.loss=pg"], "from_run")
    episodes = [{"episode_id": f"{step}{k}", "task_id": "t", "outcome_run": f"r-train0000{step}", "status": "finished",
                 "reward": reward} for step, rewards in ((1, (0.0, 1.0)), (2, (5.0, 5.0))) for k, reward in
                enumerate(rewards)]
    advantage = _advantages(episodes, cfg)
    assert advantage["10"] == pytest.approx(-advantage["11"]) and advantage["11"] > 0.5
    assert advantage["20"] == advantage["21"] == 0.0  # step 2 alone: equal rewards, no signal (not 5 vs 0.5)


def test_pg_step_accumulated_over_micro_batches_equals_one_pass_of_the_clipped_loss(tiny_model_dir):
    """trainer/offline/loop.py's pg step, in micro-batches of one row, gives the gradient of algorithms.policy_loss on
    the whole batch with the stored logprobs as the old policy."""
    import random

    from harness.core.records import Sample
    from trainer.config import load_config
    from trainer.maths import algorithms as algo
    from trainer.maths.algorithms import token_weights
    from trainer.model.fsdp import init_distributed
    from trainer.model.policy import collate, load_policy, token_logprobs
    from trainer.offline.loop import _step

    rng = random.Random(0)
    rows = []
    for i in range(3):
        n = 10 + 3 * i
        mask = [0] * 4 + [rng.choice((0, 1)) for _ in range(n - 5)] + [1]
        rows.append(Sample(f"e{i}", "r", [], [], [rng.randrange(2000) for _ in range(n)], mask,
                           [-rng.random() * 5 if m else 0.0 for m in mask]))
    advantages = [1.0, -0.5, 0.25]
    cfg = load_config(TERSE_YAML, [f"model.path={tiny_model_dir}", "offline.run=r", "offline.loss=pg",
                                   "trainer.micro_batch_tokens=1", "rollout.temperature=0.7"], "from_run")
    grads = []
    for path in ("step", "reference"):
        torch.manual_seed(0)
        model = load_policy(tiny_model_dir)
        if path == "step":
            _step(model, rows, advantages, token_weights(rows, "token-mean"), rows[0], 0, cfg, init_distributed("cpu"),
                  "pg")
        else:
            batch = collate(rows, 0)
            logprobs, _ = token_logprobs(model, batch, 0.7, loss_only=True)
            adv = torch.tensor(advantages).unsqueeze(-1) * batch.loss_mask
            t = cfg.trainer
            loss, _ = algo.policy_loss(logprobs, batch.engine_logprobs, adv, batch.loss_mask, clip_low=t.clip_low,
                                       clip_high=t.clip_high, dual_clip=t.dual_clip)
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * grads[1].abs().max()
